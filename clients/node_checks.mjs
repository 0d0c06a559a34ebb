// The official `openai` Node client against two `corolla api` servers, called the way its README shows.
//
// clients/check.py runs it with node after `npm ci` in clients/ (package-lock.json pins openai), passing
// --tool-url/--tool-model (a tiny random model with a tool-capable chat template), --smol-url/--smol-model
// (SmolLM2) and the key in COROLLA_CHECK_KEY. Each check runs on its own: a failure is recorded with its
// reason and the next check runs. Progress goes to stderr; the last stdout line is the JSON result:
// {"node-openai": {check: {"ok", "detail", "seconds"}}}.

import OpenAI from "openai";
import { VERSION } from "openai/version";

const EMBEDDING_SIZE = 576; // SmolLM2-135M's hidden size
const TEXTS = ["The sky is blue because of Rayleigh scattering.", "Corolla runs language models on a swarm."];
const WEATHER = JSON.stringify({ city: "Paris", sky: "sunny", celsius: 21 }); // the tool's result
// the city is bounded (maxLength): constrained decoding keeps a random-weight model inside a string as long
// as the schema allows
const WEATHER_TOOL = {
  type: "function",
  function: {
    name: "get_weather",
    description: "The current weather in a city.",
    parameters: {
      type: "object",
      properties: { city: { type: "string", maxLength: 24 } },
      required: ["city"],
    },
  },
};
const FORCE_WEATHER = { type: "function", function: { name: "get_weather" } };
const ASK_WEATHER = [{ role: "user", content: "What is the weather in Paris?" }];
const SAY_HELLO = [{ role: "user", content: "Say hello." }];
// the tiny model's tokenizer spends a token per byte: a call is ~60 tokens around its city, and a random
// model's city can be 24 four-byte characters
const CALL_TOKENS = 200;
const ANSWER_TOKENS = 16;
const JSON_TOKENS = 200;
const MAX_DETAIL = 600; // characters of an error in the summary
// JSON schemas as a pydantic model with extra="forbid" writes them (enums and a boolean for the random model)
const FORECAST = {
  name: "Forecast",
  schema: {
    type: "object",
    properties: { city: { type: "string", enum: ["Paris", "Oslo", "Lima"] }, sunny: { type: "boolean" } },
    required: ["city", "sunny"],
    additionalProperties: false,
  },
  strict: true,
};
const CAPITAL = {
  name: "Capital",
  schema: {
    type: "object",
    properties: { city: { type: "string" }, country: { type: "string" } },
    required: ["city", "country"],
    additionalProperties: false,
  },
  strict: true,
};

class CheckFailed extends Error {}

function require(condition, message) {
  if (!condition) throw new CheckFailed(message);
}

async function expectError(errorType, call) {
  let answer;
  try {
    answer = await call();
  } catch (error) {
    if (error instanceof errorType) return error;
    throw error;
  }
  throw new CheckFailed(`expected ${errorType.name}, got an answer: ${JSON.stringify(answer).slice(0, 300)}`);
}

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) args[argv[i].replace(/^--/, "")] = argv[i + 1];
  for (const name of ["tool-url", "tool-model", "smol-url", "smol-model"]) {
    if (!args[name]) throw new Error(`--${name} is required`);
  }
  const key = process.env.COROLLA_CHECK_KEY;
  if (!key) throw new Error("COROLLA_CHECK_KEY is not set");
  return { key, tool: { url: args["tool-url"], model: args["tool-model"] }, smol: { url: args["smol-url"], model: args["smol-model"] } };
}

const client = (target, key) => new OpenAI({ baseURL: target.url, apiKey: key, maxRetries: 0, timeout: 300_000 });

// the call was forced (tool_choice), so the answer's grammar holds calls only: any content is the call
// markup's text leaking out (e.g. an unfinished second call cut by max_tokens)
function checkToolCall(name, args, finishReason, content) {
  require(name === "get_weather", `the tool call names ${JSON.stringify(name)}, not get_weather`);
  const parsed = JSON.parse(args);
  require(parsed && typeof parsed === "object" && !Array.isArray(parsed), `the arguments are not a JSON object: ${args}`);
  require(typeof parsed.city === "string", `the arguments have no string city: ${args}`);
  require(finishReason === "tool_calls", `finish_reason is ${JSON.stringify(finishReason)}, not "tool_calls"`);
  require(!content, `a forced call came with content ${JSON.stringify(content)} (finish_reason ${finishReason})`);
  return `get_weather(${JSON.stringify(parsed)})`;
}

function checkAnswer(content, finishReason) {
  require(typeof content === "string", `the final answer's content is ${JSON.stringify(content)}, not a string`);
  return `answer ${JSON.stringify(content)} (${finishReason})`;
}

async function auth(s) {
  // this client refuses to send a request with no key at all (Missing credentials), so the first
  // request removes the header the documented way: a null header value
  const withoutKey = [client(s.smol, s.key), { headers: { Authorization: null } }];
  for (const [smol, options] of [withoutKey, [client(s.smol, `not-${s.key}`), {}]]) {
    const body = { model: s.smol.model, messages: SAY_HELLO, max_tokens: ANSWER_TOKENS };
    const error = await expectError(OpenAI.AuthenticationError, () => smol.chat.completions.create(body, options));
    require(error.status === 401, `status ${error.status}, not 401`);
  }
  const answer = await client(s.smol, s.key).chat.completions.create({
    model: s.smol.model, messages: SAY_HELLO, max_tokens: ANSWER_TOKENS, temperature: 0,
  });
  const content = answer.choices[0].message.content;
  require(content, `an empty answer with the key: ${JSON.stringify(answer.choices[0])}`);
  return `401 without a key and with a wrong one; with it: ${JSON.stringify(content)}`;
}

const askWeather = (tiny, s, extra = {}) =>
  tiny.chat.completions.create({
    model: s.tool.model, messages: ASK_WEATHER, tools: [WEATHER_TOOL], tool_choice: FORCE_WEATHER,
    max_tokens: CALL_TOKENS, temperature: 0, ...extra,
  });

const answerWeather = (tiny, s, assistant, callId, extra = {}) =>
  tiny.chat.completions.create({
    model: s.tool.model,
    messages: [...ASK_WEATHER, assistant, { role: "tool", tool_call_id: callId, content: WEATHER }],
    tools: [WEATHER_TOOL], max_tokens: ANSWER_TOKENS, temperature: 0, ...extra,
  });

async function toolRoundTrip(s) {
  const tiny = client(s.tool, s.key);
  const choice = (await askWeather(tiny, s)).choices[0];
  require(choice.message.tool_calls?.length, `no tool_calls in the answer: ${JSON.stringify(choice)}`);
  const call = choice.message.tool_calls[0];
  const shown = checkToolCall(call.function.name, call.function.arguments, choice.finish_reason, choice.message.content);
  const final = (await answerWeather(tiny, s, choice.message, call.id)).choices[0];
  return `${shown}, then ${checkAnswer(final.message.content, final.finish_reason)}`;
}

async function assemble(stream) {
  const calls = [];
  let text = "";
  let finishReason = null;
  for await (const chunk of stream) {
    for (const choice of chunk.choices) {
      text += choice.delta.content ?? "";
      for (const delta of choice.delta.tool_calls ?? []) {
        calls[delta.index] ??= { id: null, name: "", arguments: "" };
        const call = calls[delta.index];
        call.id = delta.id ?? call.id;
        call.name += delta.function?.name ?? "";
        call.arguments += delta.function?.arguments ?? "";
      }
      finishReason = choice.finish_reason ?? finishReason;
    }
  }
  return { calls: calls.filter(Boolean), text, finishReason };
}

async function toolRoundTripStream(s) {
  const tiny = client(s.tool, s.key);
  const plain = (await askWeather(tiny, s)).choices[0].message.tool_calls?.[0];
  const { calls, text, finishReason } = await assemble(await askWeather(tiny, s, { stream: true }));
  require(calls.length === 1, `${calls.length} tool calls in the stream: ${JSON.stringify(calls)}`);
  const [call] = calls;
  const shown = checkToolCall(call.name, call.arguments, finishReason, text);
  require(call.id, `the streamed call has no id: ${JSON.stringify(call)}`);
  if (plain) {
    const same = call.name === plain.function.name && JSON.stringify(JSON.parse(call.arguments)) === JSON.stringify(JSON.parse(plain.function.arguments));
    require(same, `the streamed call ${JSON.stringify(call)} is not the plain request's ${JSON.stringify(plain.function)}`);
  }
  const assistant = {
    role: "assistant", content: null,
    tool_calls: [{ id: call.id, type: "function", function: { name: call.name, arguments: call.arguments } }],
  };
  const final = await assemble(await answerWeather(tiny, s, assistant, call.id, { stream: true }));
  return `streamed ${shown}, then ${checkAnswer(final.text, final.finishReason)}`;
}

async function toolsUnsupported(s) {
  const smol = client(s.smol, s.key);
  const body = { model: s.smol.model, messages: ASK_WEATHER, tools: [WEATHER_TOOL], max_tokens: ANSWER_TOKENS };
  const error = await expectError(OpenAI.BadRequestError, () => smol.chat.completions.create(body));
  const message = String(error.message).toLowerCase();
  require(message.includes("tool") && message.includes("template"), `the 400 does not name tools and the template: ${error.message}`);
  return `400: ${error.message}`;
}

async function structured(target, key, format, question) {
  const answer = await client(target, key).chat.completions.create({
    model: target.model, messages: [{ role: "user", content: question }],
    response_format: { type: "json_schema", json_schema: format }, max_tokens: JSON_TOKENS, temperature: 0,
  });
  const { content } = answer.choices[0].message;
  const parsed = JSON.parse(content);
  const { properties, required } = format.schema;
  require(JSON.stringify(Object.keys(parsed).sort()) === JSON.stringify([...required].sort()), `keys of ${content} are not ${required}`);
  for (const [name, spec] of Object.entries(properties)) {
    require(typeof parsed[name] === spec.type, `${name} in ${content} is not a ${spec.type}`);
    require(!spec.enum || spec.enum.includes(parsed[name]), `${name} in ${content} is not one of ${spec.enum}`);
  }
  return content;
}

const structuredTiny = (s) => structured(s.tool, s.key, FORECAST, "Is it sunny in Paris? Answer in JSON.");
const structuredSmol = (s) =>
  structured(s.smol, s.key, CAPITAL, "What is the capital of France? Answer in JSON with the city and its country.");

function checkVectors(vectors) {
  require(vectors.length === 2, `${vectors.length} embeddings for 2 texts`);
  const sizes = vectors.map((v) => v.length);
  require(sizes.every((n) => n === EMBEDDING_SIZE), `embedding sizes ${sizes}, expected ${EMBEDDING_SIZE}`);
  require(vectors.flat().every((x) => typeof x === "number" && Number.isFinite(x)), "the embeddings are not arrays of numbers");
  require(vectors[0].some((x, i) => x !== vectors[1][i]), "the two texts have the same embedding");
}

function checkSame(first, again, what) {
  checkVectors(again);
  const difference = Math.max(...first.flatMap((v, i) => v.map((x, j) => Math.abs(x - again[i][j]))));
  require(difference <= 1e-5, `${what} differs from the first call by up to ${difference}`);
}

async function embeddings(s) {
  // the client asks for base64 unless told otherwise (and decodes it); float must give the same vectors
  const smol = client(s.smol, s.key);
  const embed = async (extra = {}) => {
    const { data } = await smol.embeddings.create({ model: s.smol.model, input: TEXTS, ...extra });
    return [...data].sort((a, b) => a.index - b.index).map((item) => Array.from(item.embedding));
  };
  const first = await embed();
  checkVectors(first);
  checkSame(first, await embed(), "a second call");
  checkSame(first, await embed({ encoding_format: "float" }), "encoding_format=float");
  const head = first[0].slice(0, 3).map((x) => x.toFixed(4)).join(", ");
  return `2 x ${first[0].length} ([${head}, ...]), identical on a second call and with encoding_format=float`;
}

const CHECKS = {
  auth,
  tool_round_trip: toolRoundTrip,
  tool_round_trip_stream: toolRoundTripStream,
  tools_unsupported_400: toolsUnsupported,
  structured_tiny: structuredTiny,
  structured_smollm2: structuredSmol,
  embeddings,
};

function describe(error) {
  if (error instanceof CheckFailed) return error.message;
  const where = (error.stack ?? "").split("\n").find((line) => line.includes("node_checks.mjs"));
  const at = where ? ` (at node_checks.mjs:${where.split(":").at(-2)})` : "";
  // servers' messages can span lines (a grammar, a parser's state): one line, at most MAX_DETAIL characters
  let text = String(error.message).split(/\s+/).join(" ");
  if (text.length > MAX_DETAIL) text = `${text.slice(0, MAX_DETAIL)} [...]`;
  return `${error.constructor?.name ?? "Error"}: ${text}${at}`;
}

async function main() {
  const setup = parseArgs(process.argv.slice(2));
  const results = {};
  console.error(`  node-openai ${VERSION} (node ${process.version})`);
  for (const [name, check] of Object.entries(CHECKS)) {
    const start = performance.now();
    let result;
    try {
      result = { ok: true, detail: await check(setup) };
    } catch (error) {
      result = { ok: false, detail: describe(error) };
    }
    result.seconds = Math.round(performance.now() - start) / 1000;
    console.error(`  node-openai ${name}: ${result.ok ? "ok" : "FAILED"}: ${result.detail}`);
    results[name] = result;
  }
  console.log(JSON.stringify({ "node-openai": results }));
}

await main();

"""The chat page (`GET /chat`) driven in a real headless Chromium through Playwright, on the shared SmolLM2
swarm: a question typed and sent streams the greedy answer of chat completions, each token marked with
the chain of servers that computed it (the swarm's servers, covering every block in order); the swarm's
map highlights the servers of the latest token; a follow-up continues the conversation. A screenshot of the
answer is checked: its text is drawn, underlined in the colours the map gives the servers that computed
it."""

from __future__ import annotations

import io
import re

import pytest
from PIL import Image
from playwright.sync_api import sync_playwright

from browser import ARTIFACTS, LOOPBACK_ONLY, chromium

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
# whether the page's nth answer has ended (streamed to its end, or failed)
ENDED = "n => ['done', 'error'].includes(document.querySelectorAll('.assistant')[n]?.dataset.state)"


@pytest.fixture(scope="module")
def page(smol_api):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=LOOPBACK_ONLY[1:])
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.goto(f"{smol_api.url}/chat")
        page.wait_for_selector("body[data-swarm=loaded]", timeout=30_000)
        yield page
        browser.close()


def ask(page, question: str) -> object:
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    page.fill("#prompt", question)
    count = page.locator(".assistant").count()
    page.click("#send")
    page.wait_for_function(ENDED, arg=count, timeout=60_000)
    return page.locator(".assistant").nth(count)


def colours(png: bytes) -> set[tuple[int, int, int]]:
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return {colour for _, colour in image.getcolors(maxcolors=1 << 20)}


def test_a_typed_question_streams_the_greedy_answer_marked_with_its_servers(page, smol_swarm, smol_openai):
    expected = smol_openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0
    )
    answer = ask(page, QUESTION)
    assert answer.get_attribute("data-state") == "done", answer.inner_text()
    assert answer.inner_text() == expected.choices[0].message.content

    spans = {s.peer_id: s.blocks for s in smol_swarm.servers}
    tokens = answer.locator(".token[data-route]")
    routes = tokens.evaluate_all("spans => spans.map(s => [s.dataset.route, s.dataset.blocks])")
    assert len(routes) >= expected.usage.completion_tokens - 1  # every token (the end-of-text's too)
    for route, blocks in set(map(tuple, routes)):
        pairs = zip(route.split(","), blocks.split(","), strict=True)
        hops = [(peer, *map(int, span.split(":"))) for peer, span in pairs]
        assert [start for _, start, _ in hops] == [0] + [end for _, _, end in hops[:-1]]  # contiguous
        assert hops[-1][2] == 30  # to the last block
        for peer, start, end in hops:  # each hop a part of its server's span
            assert spans[peer][0] <= start < end <= spans[peer][1], (peer, start, end)
    highlighted = page.locator(".server.answering").evaluate_all("rows => rows.map(r => r.dataset.peer)")
    assert set(highlighted) == set(routes[-1][0].split(","))
    assert "prompt tokens reused" in page.locator("#conversation .stats").last.inner_text()

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat.png"), full_page=True)
    # the latest token's servers, in their colours on the map, underline the answer on screen
    fills = page.locator(".server.answering .track div").evaluate_all(
        "fills => fills.map(fill => getComputedStyle(fill).backgroundColor)"
    )
    servers = {tuple(int(x) for x in re.findall(r"\d+", fill)) for fill in fills}
    drawn = colours(answer.screenshot())
    assert len(servers) == len(highlighted) and servers <= drawn, (servers, len(drawn))
    assert len(drawn) > 20, "the answer's text is not drawn"  # glyphs antialiased in many shades


def test_a_follow_up_continues_the_conversation(page, smol_openai):
    first = page.locator(".assistant").last.inner_text()
    follow_up = "And of Germany?"
    answer = ask(page, follow_up)
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first},
        {"role": "user", "content": follow_up},
    ]
    expected = smol_openai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    assert answer.inner_text() == expected.choices[0].message.content
    stats = page.locator("#conversation .stats").last.inner_text()
    reused = int(stats.split(" of ")[0].rsplit(", ", 1)[1])
    assert reused > 20, stats  # the first turn is the prefix the servers hold

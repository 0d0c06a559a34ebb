"""transformers' own model as the reference of training through the swarm, with the client's trainable
parts: the input prefix goes through `inputs_embeds`, and each deep prompt is added to its decoder layer's
input by a forward pre-hook. Shared by the socket-free tests (tests/unit/client/test_training_gradients.py)
and SmolLM2's over real processes (tests/integration/test_training.py)."""

from __future__ import annotations

import torch

PREFIX = 3  # the trained prompts' length (pre_seq_len)


def reference_loss(reference, input_ids, labels, prefix, deep_prompts):
    """transformers' loss with a trainable input prefix [P, H] and deep prompts [blocks, P, H]."""
    hooks = []
    for index, layer in enumerate(reference.model.layers):

        def add_prompt(module, args, kwargs, index=index):
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = torch.cat([hidden[:, :PREFIX] + deep_prompts[index], hidden[:, PREFIX:]], dim=1)
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        hooks.append(layer.register_forward_pre_hook(add_prompt, with_kwargs=True))
    try:
        embeds = reference.model.embed_tokens(input_ids)
        inputs = torch.cat([prefix[None].expand(len(input_ids), -1, -1), embeds], dim=1)
        logits = reference(inputs_embeds=inputs).logits[:, PREFIX:]
    finally:
        for hook in hooks:
            hook.remove()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )


def check_gradients(model, reference, input_ids, labels, atol=1e-4):
    """The loss of a model tuned with deep prompts (tuning_mode="deep_ptune", pre_seq_len=PREFIX) and its
    gradients wrt the prompts, the final norm and the embeddings are transformers' own."""
    torch.manual_seed(0)
    with torch.no_grad():
        model.ptune.deep_prompts.normal_(std=0.05)  # not zero, so that every path carries gradient
    model.head.requires_grad_(True)
    loss = model(input_ids, labels=labels).loss
    loss.backward()

    reference.zero_grad()
    prefix = model.ptune.prompt_embeddings.detach().clone().requires_grad_()
    deep = model.ptune.deep_prompts.detach().clone().requires_grad_()
    expected = reference_loss(reference, input_ids, labels, prefix, deep)
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=atol, rtol=0)
    torch.testing.assert_close(model.ptune.prompt_embeddings.grad, prefix.grad, atol=atol, rtol=atol)
    torch.testing.assert_close(model.ptune.deep_prompts.grad, deep.grad, atol=atol, rtol=atol)
    torch.testing.assert_close(
        model.head.norm.weight.grad, reference.model.norm.weight.grad, atol=atol, rtol=atol
    )
    torch.testing.assert_close(
        model.head.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad, atol=atol, rtol=atol
    )
    assert deep.grad.abs().sum() > 0 and prefix.grad.abs().sum() > 0
    reference.zero_grad(set_to_none=True)


def run_blocks(reference, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' decoder layers alone over hidden [B, T, H] (causal, positions from 0)."""
    length = hidden.shape[1]
    position_ids = torch.arange(length)[None]
    rotary = reference.model.rotary_emb(hidden, position_ids)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    for layer in reference.model.layers:
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
    return hidden

"""What the front-door tests (test_compat_*.py) share: tolerance, seeded inputs, gradients, no fallback."""

import contextlib
import dataclasses
import warnings

import torch

from flashtile.compat import FallbackWarning

ATOL = 1e-5


def rand(*shape, seed=0, requires_grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_(requires_grad)


def grads_of(fn, *tensors):
    out = fn(*tensors)
    out.backward(rand(*out.shape, seed=7))
    return out, [t.grad for t in tensors]


def bhsd(batch=2, hq=4, hkv=4, sq=9, sk=9, d=16, dv=None, requires_grad=False, dtype=torch.float32):
    q = rand(batch, hq, sq, d, seed=11, requires_grad=False).to(dtype)
    k = rand(batch, hkv, sk, d, seed=12).to(dtype)
    v = rand(batch, hkv, sk, dv or d, seed=13).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@contextlib.contextmanager
def no_fallback():
    """A context in which any FallbackWarning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        yield


PAGED_SDPA = "paged|sdpa"   # how transformers 5.0 and 5.17 are asked to keep sdpa for continuous batching


def generate_batch(model, prompts, max_new_tokens, **options):
    """Greedy generation of `prompts` (lists of token ids) by transformers' continuous batching (``generate_batch``,
    its paged cache): the GenerationOutput of each prompt, in order; fails if a request failed.

    `options` are ContinuousBatchingConfig fields (use_cuda_graph, return_logprobs, num_blocks, ...); transformers 5.0,
    which has no such class, reads them from the generation config. A model loaded with "sdpa" runs sdpa: where a
    flash implementation is installed, transformers switches it to that one unless asked for "paged|sdpa" (5.0, 5.17)
    or given auto_switch_to_flash=False (5.24).
    """
    import transformers

    config_class = getattr(transformers, "ContinuousBatchingConfig", None)
    if config_class is None:
        generation, kwargs = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                                                           **options), {}
    else:
        if "auto_switch_to_flash" in {field.name for field in dataclasses.fields(config_class)}:
            options = {"auto_switch_to_flash": False, **options}
        generation = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
        kwargs = {"continuous_batching_config": config_class(**options)}
    implementation = model.config._attn_implementation
    keep_sdpa = implementation == "sdpa" and PAGED_SDPA in transformers.AttentionInterface()
    if keep_sdpa:
        model.set_attn_implementation(PAGED_SDPA)
    try:
        outputs = model.generate_batch(prompts, generation_config=generation, **kwargs)
    finally:
        if keep_sdpa:
            model.set_attn_implementation(implementation)
    failed = {output.request_id: output.error for output in outputs.values() if output.error}
    assert not failed and len(outputs) == len(prompts), (failed, len(outputs))
    by_prompt = {tuple(output.prompt_ids): output for output in outputs.values()}
    return [by_prompt[tuple(prompt)] for prompt in prompts]

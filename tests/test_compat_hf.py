"""The Hugging Face front door: register_hf and the "flashtile" and "tile_attention" implementations."""

import copy
import functools
import subprocess
import sys

import pytest
import torch

import flashtile
from compat_helpers import ATOL, bhsd, generate_batch, no_fallback
from flashtile.compat import FallbackWarning, hf

pytestmark = pytest.mark.usefixtures("fresh_warnings")


def test_import_flashtile_does_not_import_transformers():
    code = "import sys, flashtile; assert 'transformers' not in sys.modules, 'transformers was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": ":".join(sys.path)})


def test_match_pattern_reads_masks():
    causal = hf._causal_pattern(4, 6, -1, "cpu")
    assert causal.tolist()[0] == [True, True, True, False, False, False]
    assert hf._match_pattern(causal[None, None].expand(2, 1, 4, 6)) == (True, -1)
    window = hf._causal_pattern(4, 6, 1, "cpu")
    assert hf._match_pattern(window[None, None]) == (True, 1)
    assert hf._match_pattern(torch.ones(1, 1, 3, 5, dtype=torch.bool)) == (False, -1)
    additive = torch.zeros(1, 1, 4, 6).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert hf._match_pattern(additive) == (True, -1)
    assert hf._match_pattern(additive.masked_fill(~causal, -1.0)) is None          # a bias, not a mask
    padded = causal[None, None].repeat(2, 1, 1, 1)
    padded[1, :, :, 0] = False
    assert hf._match_pattern(padded) is None


def transformers_major():
    return transformers_version()[0]


def transformers_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers; skips the test where it is missing."""
    transformers = pytest.importorskip("transformers")
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def tile_name():
    """Register with transformers and return "tile_attention" (on 4.x register_hf() warns that it is the only name)."""
    if transformers_major() < 5:
        with pytest.warns(UserWarning, match="needs transformers >= 5"):
            assert flashtile.register_hf() == hf.TILE_IMPLEMENTATION
    else:
        assert flashtile.register_hf() == hf.ATTN_IMPLEMENTATION
    return hf.TILE_IMPLEMENTATION


@pytest.fixture
def flash_name():
    """Register with transformers and return "flashtile"; skipped where transformers cannot take that name."""
    transformers = pytest.importorskip("transformers")
    if transformers_major() < 5:
        pytest.skip(f"transformers {transformers.__version__} has no FlashAttention loader keyed by name, so "
                    f"attn_implementation='flashtile' needs transformers >= 5 (register_hf() returns 'tile_attention')")
    name = flashtile.register_hf()
    assert name == "flashtile"
    return name


def tiny_llama(implementation, seed=0, **overrides):
    transformers = pytest.importorskip("transformers")
    options = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 128}
    config = transformers.LlamaConfig(**{**options, **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)


@pytest.fixture
def counted_calls(monkeypatch):
    """Record the causal flag and window of every call the "tile_attention" function makes to flashtile.attention."""
    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs["causal"], kwargs["window_size"]))
        return flashtile.attention(*args, **kwargs)

    monkeypatch.setattr(hf, "attention", spy)
    return calls


@pytest.fixture
def flash_calls(monkeypatch):
    """Record ("dense" or "varlen", causal, window) for every call flashtile's FA2 functions make to flashtile's API."""
    from flashtile.compat import flash_attn as fa

    calls = []

    def spy(kind, function):
        def record(*args, **kwargs):
            calls.append((kind, kwargs["causal"], tuple(kwargs["window_size"])))
            return function(*args, **kwargs)
        return record

    monkeypatch.setattr(fa, "attention", spy("dense", fa.attention))
    monkeypatch.setattr(fa, "varlen_attention", spy("varlen", fa.varlen_attention))
    return calls


def model_pair(name, reference="sdpa", **overrides):
    ours, theirs = tiny_llama(name, **overrides), tiny_llama(reference, **overrides)
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == name and theirs.config._attn_implementation == reference
    return ours, theirs


def tiny_mistral_config(transformers):
    """A two-layer Mistral with GQA (4 query heads, 2 key/value heads) and a 4-token sliding window."""
    return transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=128, sliding_window=4)


def same_model(transformers, config, *implementations):
    models = []
    for implementation in implementations:
        torch.manual_seed(0)
        models.append(transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                                    attn_implementation=implementation))
    return models


def assert_matches_and_trains(ours, theirs, out, ref, ids):
    """Same logits and loss gradients as the reference model, and five AdamW steps lower the loss."""
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=ATOL)
    out.loss.backward()
    ref.loss.backward()
    assert_same_gradients(ours, theirs)

    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = ours(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def assert_same_gradients(ours, theirs):
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def left_padded(batch=2, seqlen=10, pad=3, seed=18):
    ids = torch.randint(0, 128, (batch, seqlen), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    mask[0, :pad] = 0
    return ids, mask


# -- "flashtile": transformers' FlashAttention path with flashtile's FA2 functions --

def flash_loader():
    return sys.modules["transformers.modeling_flash_attention_utils"]


def test_register_hf_registers_both_names_idempotently(flash_name):
    transformers = sys.modules["transformers"]
    from transformers.utils.generic import is_flash_attention_requested

    assert flashtile.register_hf() == flashtile.register_hf() == flash_name
    functions, masks = transformers.AttentionInterface(), transformers.masking_utils.AttentionMaskInterface()
    assert functions[flash_name] is hf.flashtile_flash_attention_forward
    assert masks[flash_name] is masks["flash_attention_2"]
    assert functions[hf.TILE_IMPLEMENTATION] is hf.flashtile_attention_forward
    assert masks[hf.TILE_IMPLEMENTATION] is masks["sdpa"]
    assert is_flash_attention_requested(requested_attention_implementation=flash_name)  # why the loader is needed
    loader = flash_loader()
    assert loader._lazy_imports.flashtile_loader and not hasattr(loader._lazy_imports.__wrapped__, "flashtile_loader")
    assert loader._loaded_implementation == flash_name and hf._primed(loader)
    assert loader._lazy_imports(hf.PAGED_IMPLEMENTATION)[1] is flashtile.flash_attn_varlen_func   # continuous batching
    if hf.PAGED_TWIN in functions:   # 5.0, 5.17: continuous batching asks for "paged|flashtile"
        assert functions[hf.PAGED_IMPLEMENTATION] is functions[hf.PAGED_TWIN]
    else:
        assert hf.PAGED_IMPLEMENTATION not in functions


def test_register_hf_on_transformers_4_registers_tile_attention_only(monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    with pytest.warns(UserWarning, match=r"'flashtile' needs transformers >= 5 \(this is 4.57.6"):
        assert flashtile.register_hf() == hf.TILE_IMPLEMENTATION
    assert transformers.AttentionInterface()[hf.TILE_IMPLEMENTATION] is hf.flashtile_attention_forward


def test_register_hf_refuses_unexpected_transformers_internals_and_changes_nothing(flash_name, monkeypatch):
    transformers, loader = sys.modules["transformers"], flash_loader()
    state = {name: getattr(loader, name) for name in hf.LOADER_STATE if hasattr(loader, name)}
    monkeypatch.delattr(loader, "_pad_input")
    with pytest.raises(ImportError, match=rf"transformers {transformers.__version__} .*missing _pad_input.*"
                                          r"use attn_implementation='tile_attention'"):
        flashtile.register_hf()
    monkeypatch.undo()
    monkeypatch.setattr(loader, "_loaded_implementation", "kernels-community/other")
    monkeypatch.setattr(loader, "lazy_import_flash_attention", lambda *args, **kwargs: None)  # loads nothing
    with pytest.raises(ImportError, match="did not keep flashtile's functions"):
        flashtile.register_hf()
    assert loader._loaded_implementation == "kernels-community/other" and loader._lazy_imports is state["_lazy_imports"]
    monkeypatch.undo()
    assert all(getattr(loader, name) is value for name, value in state.items())
    assert transformers.AttentionInterface()[hf.TILE_IMPLEMENTATION] is hf.flashtile_attention_forward


def test_hf_flashtile_llama_logits_gradients_and_training(flash_name, flash_calls):
    ours, theirs = model_pair(flash_name)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(15))
    out = ours(ids, labels=ids)
    ref = theirs(ids, labels=ids)
    assert flash_calls == [("dense", True, (-1, -1))] * 2   # both layers served by flashtile's flash_attn_func
    assert_matches_and_trains(ours, theirs, out, ref, ids)


def test_hf_flashtile_left_padding_logits_and_gradients(flash_name, flash_calls):
    ours, theirs = model_pair(flash_name)
    ids, mask = left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    with no_fallback():
        out = ours(ids, attention_mask=mask, labels=labels)
    ref = theirs(ids, attention_mask=mask, labels=labels)
    assert flash_calls == [("varlen", True, (-1, -1))] * 2   # unpadded and served, no fallback
    valid = mask.bool()   # FlashAttention leaves the outputs of padding positions zero, sdpa does not
    torch.testing.assert_close(out.logits[valid], ref.logits[valid], rtol=0, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    assert_same_gradients(ours, theirs)


def test_hf_flashtile_generate_with_kv_cache(flash_name, flash_calls):
    ours, theirs = model_pair(flash_name)
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(16))
    tokens = ours.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, theirs.generate(prompt, max_new_tokens=6, do_sample=False))
    assert flash_calls == [("dense", True, (-1, -1))] * (2 * 6)   # prefill, then decoding one token at a time

    flash_calls.clear()
    ids, mask = left_padded()
    tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    assert flash_calls == [("varlen", True, (-1, -1))] * (2 * 6)

    flash_calls.clear()   # a static cache: its empty slots are cut off through the mask transformers keeps for flash
    options = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
    paddings = (mask, torch.ones_like(mask)) if flash_mask_keeps_static_cache_slots() else (mask,)
    for padding in paddings:
        tokens = ours.generate(ids, attention_mask=padding, **options)
        assert torch.equal(tokens, theirs.generate(ids, attention_mask=padding, **options))
    served = {("varlen", True, (-1, -1)), ("dense", True, (-1, -1))}
    assert len(flash_calls) == len(paddings) * 2 * 6 and set(flash_calls) <= served


def flash_mask_keeps_static_cache_slots():
    """False in transformers 5.0.0: its flash_attention_mask drops an all-ones mask shorter than the static cache,
    so every flash implementation (flash_attn's too) then attends to the cache's empty slots; fixed by 5.17."""
    from transformers.masking_utils import flash_attention_mask

    return flash_attention_mask(1, 2, 4, attention_mask=torch.ones(1, 2, dtype=torch.bool)) is not None


NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 13, 9)
PAD_ID = 0
CPU_BATCHING = {"num_blocks": 4, "max_batch_tokens": 64}  # a small paged cache (not sized from the machine's memory)
CB_ON_CPU_SINCE = (5, 17)   # 5.0 sizes continuous batching's cache from CUDA, XPU or MPS memory only
CB_WITHOUT_PSUTIL_SINCE = (5, 24)  # 5.17 reads the CPU's free memory with psutil and fails without it; 5.24 does not


def skip_without_cpu_batching():
    """Skip where transformers' continuous batching cannot run on the CPU (tested: 5.0, 5.17 without psutil)."""
    version, name = transformers_version(), sys.modules["transformers"].__version__
    if torch.cuda.is_available():  # it then sizes its cache with CUDA's memory calls; tests/test_hf_gpu.py runs it there
        pytest.skip("transformers' continuous batching runs on the GPU where one is present (tests/test_hf_gpu.py)")
    if version < CB_ON_CPU_SINCE:
        pytest.skip(f"transformers {name} runs continuous batching on CUDA, XPU or MPS only")
    if version < CB_WITHOUT_PSUTIL_SINCE:
        pytest.importorskip("psutil", reason=f"transformers {name} needs psutil for continuous batching on the CPU")


def random_prompts(seed=24):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def greedy_generate(model, prompts, **options):
    """The NEW_TOKENS greedy tokens `generate` gives each prompt, the prompts batched with left padding."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID,
                         **options)
    return out[:, width:].tolist()


def greedy_generate_batch(model, prompts, **options):
    """The NEW_TOKENS greedy tokens continuous batching gives each prompt."""
    return [out.generated_tokens for out in generate_batch(model, prompts, NEW_TOKENS, **CPU_BATCHING, **options)]


@pytest.mark.parametrize("setting", ["dynamic-cache", "static-cache", "continuous-batching"])
def test_hf_flashtile_greedy_generation_as_sdpa(setting, flash_name, flash_calls):
    """Prompts of three lengths, NEW_TOKENS greedy tokens each: the same tokens as sdpa, every call served."""
    if setting == "continuous-batching":
        skip_without_cpu_batching()
        generate = greedy_generate_batch
    else:
        options = {"cache_implementation": "static"} if setting == "static-cache" else {}
        generate = functools.partial(greedy_generate, **options)
    ours, theirs = model_pair(flash_name, eos_token_id=None)   # no end of sequence: every prompt gets NEW_TOKENS
    prompts = random_prompts()
    tokens = generate(ours, prompts)
    served = list(flash_calls)
    assert tokens == generate(theirs, prompts)
    assert [len(t) for t in tokens] == [NEW_TOKENS] * len(prompts)
    assert set(served) == {("varlen", True, (-1, -1))}   # padded batches in generate, packed ones in batching
    layers = 2
    if setting == "continuous-batching":   # a forward pass per token at least (a scheduler may split a prefill)
        assert len(served) % layers == 0 and len(served) >= layers * NEW_TOKENS
    else:                                  # the prefill, then one forward pass per further token
        assert len(served) == layers * NEW_TOKENS


def test_hf_flashtile_continuous_batching_with_batches_padded_as_for_cuda_graphs(flash_name, flash_calls,
                                                                                  monkeypatch):
    """On CUDA, continuous batching pads its batches to fixed sizes to capture them in CUDA graphs (its default for
    a flash name): packed q, k and v then have rows past the last sequence. Forced here on the CPU."""
    skip_without_cpu_batching()
    model_runner = pytest.importorskip("transformers.generation.continuous_batching.model_runner")
    from flashtile.compat import flash_attn as fa

    unpadded = model_runner.ModelRunner.__init__

    def padding(self, *args, **kwargs):
        unpadded(self, *args, **kwargs)
        self.pad_inputs = True

    used_rows, padded = fa._used_rows, []

    def spy(*args):
        padded.append(used_rows(*args))
        return padded[-1]

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padding)
    monkeypatch.setattr(fa, "_used_rows", spy)
    ours, theirs = model_pair(flash_name, eos_token_id=None)
    prompts = random_prompts()
    padding_sizes = {"q_padding_interval_size": 16, "kv_padding_interval_size": 32}
    tokens = greedy_generate_batch(ours, prompts, **padding_sizes)
    assert any(rows is not None for rows in padded), "no padded batch reached flashtile"
    assert tokens == greedy_generate_batch(theirs, prompts, **padding_sizes)
    assert flash_calls and set(flash_calls) == {("varlen", True, (-1, -1))}


def test_hf_flashtile_packed_sequences_do_not_attend_across(flash_name, flash_calls):
    ours, theirs = model_pair(flash_name)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(20))
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]   # two sequences in one row, no padding
    logits = ours(ids, position_ids=position_ids, use_cache=False).logits
    assert flash_calls == [("varlen", True, (-1, -1))] * 2
    torch.testing.assert_close(logits, theirs(ids, position_ids=position_ids, use_cache=False).logits,
                               rtol=0, atol=ATOL)
    alone = ours(ids[:, 5:], use_cache=False).logits   # the second sequence by itself
    torch.testing.assert_close(logits[:, 5:], alone, rtol=0, atol=ATOL)
    flash_calls.clear()
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)   # as padding-free collators pass them
    packed = ours(ids, position_ids=position_ids, use_cache=False, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                  max_length_q=7, max_length_k=7).logits
    torch.testing.assert_close(packed, logits, rtol=0, atol=ATOL)
    assert flash_calls == [("varlen", True, (-1, -1))] * 2


def test_hf_flashtile_sliding_window_and_softcap(flash_name, flash_calls):
    transformers = sys.modules["transformers"]
    config = tiny_mistral_config(transformers)
    ours, theirs = same_model(transformers, config, flash_name, "sdpa")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(17))
    logits = ours(ids).logits
    assert flash_calls == [("dense", True, (3, 3))] * 2   # transformers' window (3, 3); causal: 3 keys to the left
    torch.testing.assert_close(logits, theirs(ids).logits, rtol=0, atol=ATOL)

    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                       max_position_embeddings=128, sliding_window=4, attn_logit_softcapping=1.0,
                                       initializer_range=0.5)  # scores large enough for the cap to matter
    ours, theirs = same_model(transformers, config, flash_name, "eager")
    ids, mask = left_padded()
    valid = mask.bool()
    for kwargs in ({}, {"attention_mask": mask}):
        logits, ref = ours(ids, **kwargs).logits, theirs(ids, **kwargs).logits
        rows = valid if kwargs else torch.ones_like(valid)
        torch.testing.assert_close(logits[rows], ref[rows], rtol=ATOL, atol=ATOL)


def test_hf_flashtile_four_d_mask_goes_to_the_tile_path(flash_name, flash_calls, counted_calls):
    ours, theirs = model_pair(flash_name)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(21))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].expand(2, 1, 9, 9)   # a caller's own 4-D mask
    with no_fallback():
        logits = ours(ids, attention_mask=causal).logits
    assert flash_calls == [] and counted_calls == [(True, (-1, -1))] * 2
    torch.testing.assert_close(logits, theirs(ids, attention_mask=causal).logits, rtol=0, atol=ATOL)


def test_hf_flashtile_works_after_another_flash_implementation_was_loaded(flash_name, flash_calls, monkeypatch):
    ours, theirs = model_pair(flash_name)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(22))
    loader = flash_loader()

    def other_flash_loaded():   # what transformers' loader holds after a call of another flash implementation
        def not_flashtile(*args, **kwargs):
            raise AssertionError("another implementation's function was called")
        monkeypatch.setattr(loader, "_loaded_implementation", "kernels-community/flash-attn2")
        monkeypatch.setattr(loader, "_flash_fn", not_flashtile)
        monkeypatch.setattr(loader, "_flash_varlen_fn", not_flashtile)

    other_flash_loaded()
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=0, atol=ATOL)   # a call loads it again
    assert loader._loaded_implementation == flash_name and hf._primed(loader)
    other_flash_loaded()
    again = tiny_llama(flash_name)                                                         # and so does loading
    assert hf._primed(loader)
    again.load_state_dict(ours.state_dict())
    torch.testing.assert_close(again(ids).logits, theirs(ids).logits, rtol=0, atol=ATOL)
    assert len(flash_calls) == 2 * 2


def test_hf_flashtile_refuses_dropout_and_sinks(flash_name):
    ours = tiny_llama(flash_name, attention_dropout=0.1)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(23))
    ours.eval()(ids)   # no dropout in eval mode
    with pytest.raises(ValueError, match="does not support attention dropout.*'tile_attention'"):
        ours.train()(ids)
    module = ours.model.layers[0].self_attn
    q, k, v = bhsd(hkv=2)
    with pytest.raises(ValueError, match=r"attention sinks \(s_aux\)"):
        hf.flashtile_flash_attention_forward(module, q, k, v, None, s_aux=torch.zeros(4))


# -- "tile_attention": flashtile_attention_forward with sdpa's masks --

def test_hf_llama_logits_gradients_and_training(counted_calls):
    ours, theirs = model_pair(tile_name())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(15))
    with no_fallback():
        out = ours(ids, labels=ids)
    ref = theirs(ids, labels=ids)
    assert counted_calls == [(True, (-1, -1))] * 2   # both layers served by flashtile
    assert_matches_and_trains(ours, theirs, out, ref, ids)


def test_hf_generate_with_kv_cache(counted_calls):
    ours, theirs = model_pair(tile_name())
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(16))
    with no_fallback():
        tokens = ours.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, theirs.generate(prompt, max_new_tokens=6, do_sample=False))
    assert counted_calls[:2] == [(True, (-1, -1))] * 2 and len(counted_calls) == 2 * 6   # prefill, then decoding


def test_hf_sliding_window_mask_is_served(counted_calls):
    name = tile_name()
    transformers = sys.modules["transformers"]
    config = tiny_mistral_config(transformers)
    ours, theirs = same_model(transformers, config, name, "sdpa")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(17))
    with no_fallback():
        logits = ours(ids).logits
    assert counted_calls == [(True, (3, -1))] * 2
    torch.testing.assert_close(logits, theirs(ids).logits, rtol=0, atol=ATOL)


def test_hf_padding_mask_falls_back_to_sdpa_once(counted_calls):
    ours, theirs = model_pair(tile_name())
    ids, mask = left_padded()
    with pytest.warns(FallbackWarning, match="padding") as record:
        logits = ours(ids, attention_mask=mask).logits
    assert len(record) == 1 and counted_calls == []
    torch.testing.assert_close(logits, theirs(ids, attention_mask=mask).logits, rtol=0, atol=ATOL)
    with no_fallback():
        ours(ids, attention_mask=torch.ones(2, 10, dtype=torch.long))   # all ones: no padding, flashtile serves it
    assert len(counted_calls) == 2


def test_hf_no_mask_with_more_keys_means_top_left_causal_as_in_sdpa():
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q, k, v = bhsd(hkv=2, sq=4, sk=9)   # a prefill into a static cache whose last slots are still empty
    with no_fallback():
        out, weights = hf.flashtile_attention_forward(module, q, k, v, None, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 4, 4, 16) and transformers is sys.modules["transformers"]
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


def test_hf_softcap_served_and_padding_falls_back_to_eager(counted_calls):
    name = tile_name()
    transformers = sys.modules["transformers"]
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                       max_position_embeddings=128, sliding_window=4, attn_logit_softcapping=1.0,
                                       initializer_range=0.5)  # scores large enough for the cap to matter
    ours, theirs = same_model(transformers, config, name, "eager")
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(19))
    with no_fallback():
        logits = ours(ids).logits
    assert sorted(counted_calls) == [(True, (-1, -1)), (True, (3, -1))]   # one full layer, one sliding layer
    torch.testing.assert_close(logits, theirs(ids).logits, rtol=ATOL, atol=ATOL)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    with pytest.warns(FallbackWarning, match="eager"):
        logits = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, theirs(ids, attention_mask=mask).logits, rtol=ATOL, atol=ATOL)

"""A tiny Llama from transformers trained and generating on the H200 with attn_implementation="flashtile", beside
torch SDPA (bf16)."""

import copy
import warnings

import pytest
import torch

import flashtile
from compat_helpers import generate_batch
from flashtile.compat import FallbackWarning
from flashtile.compat import flash_attn as fa

pytestmark = pytest.mark.gpu  # skipped where no CUDA device exists (conftest.py)
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"attn_implementation='flashtile' needs transformers >= 5, this is {transformers.__version__}",
                allow_module_level=True)

NAME = "flashtile"
CONFIG = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024}
STEPS = 20
LOSS_DROP = 1.0           # nats the loss must fall over STEPS (measured: 6.3 -> 3.7)
LOSS_AGREEMENT = 0.05     # final losses of flashtile and sdpa within 5% of the starting loss
BF16_LOGIT_TOL = 5e-2     # two bf16 implementations of one model: logits agree to bf16's ~3 significant digits
GRAD_COSINE = 0.99        # loss gradients point the same way in every parameter
PADDING = 37              # left padding of the first row in the padded case
NEW_TOKENS = 24           # greedy tokens generated for each prompt
PROMPT_LENGTHS = (37, 100, 150)
PAD_ID = 0
# Greedy tokens of two bf16 implementations agree only where the model is decided: their logits differ by up to
# BF16_LOGIT_TOL each way, so where sdpa's top two logits are closer than twice that, either token is a faithful
# greedy choice and the generations may part (a random tiny Llama meets such near ties within a few tokens: on the
# CPU, bf16 sdpa and bf16 flashtile part on one prompt in three). Up to the first near tie the tokens must be equal;
# at every step the token must be sdpa's greedy choice within GREEDY_TIE, with the log-probability sdpa gives it.
GREEDY_TIE = 2 * BF16_LOGIT_TOL
CUDA_BATCHING = {"num_blocks": 16, "max_batch_tokens": 512}  # a paged cache of 4096 tokens, not sized from memory


def _model(implementation: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
    return model.to(device="cuda", dtype=torch.bfloat16)


def _pair():
    assert flashtile.register_hf() == NAME
    ours, theirs = _model(NAME), _model("sdpa")
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.fixture
def served(monkeypatch):
    """The kinds of calls ("dense", "varlen") flashtile's FlashAttention-2 functions make to flashtile's API."""
    calls = []
    for kind, name in (("dense", "attention"), ("varlen", "varlen_attention")):
        function = getattr(fa, name)
        monkeypatch.setattr(fa, name, lambda *a, _f=function, _k=kind, **kw: calls.append(_k) or _f(*a, **kw))
    return calls


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "left-padding"])
def test_llama_logits_and_gradients_match_sdpa(padded, served):
    ours, theirs = _pair()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 300), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :PADDING if padded else 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    kwargs = {"attention_mask": mask, "labels": labels} if padded else {"labels": labels}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # every layer must be served by flashtile
        out = ours(ids, **kwargs)
    ref = theirs(ids, **kwargs)
    assert served == ["varlen" if padded else "dense"] * CONFIG["num_hidden_layers"]
    valid = mask.bool()   # FlashAttention leaves padding positions' outputs zero, sdpa does not
    torch.testing.assert_close(out.logits[valid].float(), ref.logits[valid].float(), rtol=0, atol=BF16_LOGIT_TOL)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        cosine = torch.nn.functional.cosine_similarity(p.grad.float().flatten(), q.grad.float().flatten(), dim=0)
        assert cosine > GRAD_COSINE, (name, cosine.item())


def test_llama_loss_falls_over_training_as_with_sdpa():
    losses = {}
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 256), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(2))
    for name, model in zip(("ours", "sdpa"), _pair()):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[name] = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    ours, sdpa = losses["ours"], losses["sdpa"]
    assert ours[-1] < ours[0] - LOSS_DROP, ours
    assert abs(ours[-1] - sdpa[-1]) < LOSS_AGREEMENT * sdpa[0], (ours, sdpa)


def _generating_pair():
    """_pair() without an end-of-sequence token, so that every prompt gets NEW_TOKENS (a random model may emit it)."""
    pair = _pair()
    for model in pair:
        model.generation_config.eos_token_id = None
    return pair


def _prompts():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _generate(model, prompts, **options):
    """Each prompt's NEW_TOKENS greedy tokens and their log-probabilities from `generate`, the prompts batched with
    left padding."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID,
                         output_logits=True, return_dict_in_generate=True, **options)
    tokens = out.sequences[:, width:]
    logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1).gather(2, tokens[..., None])[..., 0]
    return tokens.tolist(), logprobs.tolist()


def _generate_batch(model, prompts, **options):
    """Each prompt's NEW_TOKENS greedy tokens and their log-probabilities from continuous batching."""
    outputs = generate_batch(model, prompts, NEW_TOKENS, return_logprobs=True, **CUDA_BATCHING, **options)
    return [out.generated_tokens for out in outputs], [out.logprobs for out in outputs]


def _assert_greedy_as_sdpa(sdpa, prompts, generated, reference):
    """`generated` (tokens, log-probabilities) is sdpa's greedy generation up to near ties (GREEDY_TIE): the tokens
    equal sdpa's own `reference` tokens up to the first near tie, and each one is, for its prefix, within GREEDY_TIE
    of sdpa's best logit with sdpa's log-probability within GREEDY_TIE."""
    for prompt, tokens, logprobs, expected in zip(prompts, *generated, reference):
        assert len(tokens) == len(logprobs) == NEW_TOKENS
        with torch.no_grad():
            logits = sdpa(torch.tensor([prompt + tokens], device="cuda"), use_cache=False).logits
        logits = logits[0, len(prompt) - 1:-1].float()   # the logits that chose each generated token
        chosen = torch.tensor(tokens, device="cuda")[:, None]
        top = logits.topk(2).values
        gaps = top[:, 0] - logits.gather(1, chosen)[:, 0]
        assert bool((gaps <= GREEDY_TIE).all()), gaps.tolist()
        torch.testing.assert_close(torch.tensor(logprobs, device="cuda"),
                                   logits.log_softmax(-1).gather(1, chosen)[:, 0], rtol=0, atol=GREEDY_TIE)
        ties = (top[:, 0] - top[:, 1] < GREEDY_TIE).nonzero()
        decided = int(ties[0]) if len(ties) else NEW_TOKENS
        assert tokens[:decided] == expected[:decided], (decided, tokens, expected)


@pytest.mark.parametrize("cache", ["dynamic", "static", "static-compiled"])
def test_llama_generates_greedy_tokens_as_sdpa(cache, served):
    """`generate` with a dynamic cache and with a static one, eager and as transformers compiles it by default on
    CUDA; the prompts are batched with left padding, so every call is served by flashtile's varlen function."""
    ours, theirs = _generating_pair()
    prompts = _prompts()
    static = {"cache_implementation": "static"} if cache != "dynamic" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        generated = _generate(ours, prompts, disable_compile=cache != "static-compiled", **static)
    reference, _ = _generate(theirs, prompts, disable_compile=True, **static)
    layers = CONFIG["num_hidden_layers"]
    if cache == "static-compiled":   # the prefill runs eagerly; compiled steps need not reach Python
        assert served[:layers] == ["varlen"] * layers and set(served) == {"varlen"}
    else:
        assert served == ["varlen"] * (layers * NEW_TOKENS)
    _assert_greedy_as_sdpa(theirs, prompts, generated, reference)


@pytest.mark.parametrize("graphs", [None, False], ids=["cuda-graphs", "no-graphs"])
def test_llama_continuous_batching_generates_greedy_tokens_as_sdpa(graphs, served):
    """`generate_batch`: continuous batching with its paged cache; by default (use_cuda_graph None) transformers
    captures CUDA graphs of a flash implementation's batches, padded to fixed sizes."""
    ours, theirs = _generating_pair()
    prompts = _prompts()
    generated = _generate_batch(ours, prompts, use_cuda_graph=graphs)
    reference, _ = _generate_batch(theirs, prompts, use_cuda_graph=False)
    assert served and set(served) == {"varlen"}   # replayed graphs do not reach Python: no count
    _assert_greedy_as_sdpa(theirs, prompts, generated, reference)

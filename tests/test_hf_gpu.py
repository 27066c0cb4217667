"""A tiny Llama from transformers trained on the H200 with attn_implementation="flashtile", beside torch SDPA (bf16)."""

import copy
import warnings

import pytest
import torch

import flashtile
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

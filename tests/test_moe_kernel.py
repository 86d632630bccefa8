"""The native MoE experts operation (churon._cpu.MoeExperts, NativeBackend.moe_experts) against the experts run one
at a time through the native backend's linear and swiglu (backend.experts_one_by_one, the loop DecoderBlock.moe ran):
bitwise equal on random routings, in every type the experts may be stored in, on 1 and 2 threads and on each ISA; a
token's bits independent of its batch; bad inputs a clear error."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from churon import kernels
from churon.formats.gguf import GGUFTensor
from churon.model.backend import experts_one_by_one
from churon.model.weights import quantized

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason)

HIDDEN, FFN, EXPERTS = 256, 256, 8  # K-quants need multiples of 256 columns
QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32]


def make_experts(backend, qtype: Q, seed: int = 0, num_experts: int = EXPERTS):
    """Random experts at a trained model's scale (N(0, 1 / fan_in)), stored as qtype's GGUF blocks."""
    g = torch.Generator().manual_seed(seed)

    def weight(rows, cols, name):
        w = torch.randn(rows, cols, generator=g) * cols**-0.5
        if qtype == Q.F32:
            return GGUFTensor(name, (rows, cols), Q.F32, w.numpy().view("uint8").reshape(-1))
        return quantized(w, qtype, name)

    gate_up = [weight(2 * FFN, HIDDEN, f"gate_up{e}") for e in range(num_experts)]
    down = [weight(HIDDEN, FFN, f"down{e}") for e in range(num_experts)]
    return backend.experts(gate_up, down)


def routing(tokens: int, k: int, seed: int, experts: range | list[int] = range(EXPERTS)):
    """Each token's k distinct experts (drawn from `experts`) and renormalized weights, as the router gives them."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(list(experts))
    chosen = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g) + 0.05
    return chosen, weights / weights.sum(-1, keepdim=True)


def hidden_states(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def backend():
    from churon.model.native_backend import NativeBackend

    return NativeBackend()


@pytest.fixture(scope="module", params=QTYPES, ids=lambda q: q.name)
def experts(request, backend):
    return make_experts(backend, request.param)


# (tokens, k, the experts the tokens choose from): experts no token chooses, T = 1, T = 1000, k = 1, k = 8
ROUTINGS = {
    "random": (37, 4, range(EXPERTS)),
    "some-unused": (50, 2, [1, 4, 6]),
    "one-token": (1, 4, range(EXPERTS)),
    "k1": (64, 1, range(EXPERTS)),
    "k8-every-expert": (20, 8, range(EXPERTS)),
    "1000-tokens": (1000, 4, range(EXPERTS)),
}


@pytest.mark.parametrize("normalize", [False, True], ids=["weights", "normalize"])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("case", list(ROUTINGS))
def test_the_native_op_equals_the_experts_one_by_one_bitwise(backend, experts, case, n_threads, normalize, threads):
    """normalize: the raw top-k probabilities, renormalized inside (as torch divides by their rank-ordered sum)."""
    threads(n_threads)
    tokens, k, pool = ROUTINGS[case]
    chosen, weights = routing(tokens, k, seed=tokens + k, experts=pool)
    if normalize:
        weights = weights * torch.rand(tokens, 1, generator=torch.Generator().manual_seed(k)) * 0.9
    h = hidden_states(tokens, seed=tokens)
    out = backend.moe_experts(experts, h, chosen, weights, normalize)
    assert torch.equal(out, experts_one_by_one(backend, experts, h, chosen, weights, normalize))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("n_threads", [1, 2])
def test_one_expert_chosen_by_every_token(backend, experts, n_threads, threads):
    """Expert 5 at every token's rank 0, then at rank 2 (the other ranks random, without it)."""
    threads(n_threads)
    tokens, k = 300, 3
    chosen, weights = routing(tokens, k, seed=11, experts=[e for e in range(EXPERTS) if e != 5])
    h = hidden_states(tokens, seed=12)
    for rank in (0, 2):
        chosen_5 = chosen.clone()
        chosen_5[:, rank] = 5
        out = backend.moe_experts(experts, h, chosen_5, weights)
        assert torch.equal(out, experts_one_by_one(backend, experts, h, chosen_5, weights))


def test_a_token_s_bits_do_not_depend_on_its_batch_or_the_thread_count(backend, experts, threads):
    """Tokens alone, in a batch of 200 that shares their experts, and on 1 and 2 threads: the same bits."""
    chosen, weights = routing(200, 4, seed=21)
    h = hidden_states(200, seed=22)
    threads(2)
    batched = backend.moe_experts(experts, h, chosen, weights)
    threads(1)
    assert torch.equal(backend.moe_experts(experts, h, chosen, weights), batched)
    for t in (0, 77, 199):
        alone = backend.moe_experts(experts, h[t : t + 1], chosen[t : t + 1], weights[t : t + 1])
        assert torch.equal(alone[0], batched[t])
    part = backend.moe_experts(experts, h[50:90], chosen[50:90], weights[50:90])
    assert torch.equal(part, batched[50:90])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.F16], ids=lambda q: q.name)
def test_each_isa(backend, qtype, isa, threads):
    threads(2)
    experts = make_experts(backend, qtype, seed=1)
    chosen, weights = routing(45, 4, seed=31)
    h = hidden_states(45, seed=32)
    assert torch.equal(backend.moe_experts(experts, h, chosen, weights),
                       experts_one_by_one(backend, experts, h, chosen, weights))


def test_mixed_types_per_projection(backend):
    """A Q4_K_M file's experts: gate_up in one type, down in another (here float gate_up and Q6_K down)."""
    e32, e6 = make_experts(backend, Q.F32, seed=2), make_experts(backend, Q.Q6_K, seed=3)
    gate_up, down = e32.gate_up, e6.down
    mixed = type(e32)(gate_up, down, kernel=kernels.cpu.MoeExperts(gate_up, down))
    chosen, weights = routing(33, 4, seed=41)
    h = hidden_states(33, seed=42)
    assert torch.equal(backend.moe_experts(mixed, h, chosen, weights),
                       experts_one_by_one(backend, mixed, h, chosen, weights))


def test_no_tokens(backend, experts):
    out = backend.moe_experts(experts, torch.empty(0, HIDDEN), torch.empty(0, 4, dtype=torch.int64), torch.empty(0, 4))
    assert out.shape == (0, HIDDEN)


@pytest.fixture(scope="module")
def q4(backend):
    return make_experts(backend, Q.Q4_0, seed=5)


@pytest.mark.parametrize("bad_id", [-1, EXPERTS, 1 << 40])
def test_an_expert_id_out_of_range_is_an_index_error(backend, q4, bad_id):
    chosen, weights = routing(6, 2, seed=51)
    chosen[4, 1] = bad_id
    with pytest.raises(IndexError, match=rf"token 4 \(rank 1\) chose expert {bad_id}, outside \[0, {EXPERTS}\)"):
        backend.moe_experts(q4, hidden_states(6, seed=52), chosen, weights)


@pytest.mark.parametrize("h, chosen, weights, message", [
    (torch.zeros(3, HIDDEN + 32), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2), r"h must be \[tokens, 256\]"),
    (torch.zeros(3, HIDDEN), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2), r"ids must be \[3, k\]"),
    (torch.zeros(3, HIDDEN), torch.zeros(3, 0, dtype=torch.int64), torch.ones(3, 0), r"ids must be \[3, k\]"),
    (torch.zeros(3, HIDDEN), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 3), "weights must have the shape"),
    (torch.zeros(3, HIDDEN), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2), "ids must be torch.int64"),
    (torch.zeros(3, HIDDEN), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2).double(), "weights must be torch.float32"),
    (torch.zeros(3, HIDDEN, dtype=torch.float16), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2), "h must be torch.float32"),
])
def test_shapes_and_dtypes_that_disagree_are_value_errors(backend, q4, h, chosen, weights, message):
    with pytest.raises(ValueError, match=message):
        backend.moe_experts(q4, h, chosen, weights)


def test_experts_of_different_shapes_are_refused(backend, q4):
    small = make_experts(backend, Q.Q4_0, seed=6, num_experts=2)
    with pytest.raises(ValueError, match="as many down matrices as gate_up"):
        kernels.cpu.MoeExperts(q4.gate_up, q4.down[:3])
    with pytest.raises(ValueError, match="expert 1 has gate_up 256 x 256"):
        kernels.cpu.MoeExperts([q4.gate_up[0], small.down[0]], q4.down[:2])
    with pytest.raises(ValueError, match="as many down matrices"):
        kernels.cpu.MoeExperts([], [])


# --- routing in the same call: the softmax routers' (every MoE family but gpt-oss) ------------------------------

def make_router(backend, qtype: Q, seed: int):
    """A router at a trained model's decisive scale (3x N(0, 1 / hidden)): top-k choices rarely near a tie."""
    w = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 3 * HIDDEN**-0.5
    return backend.matrix(w if qtype == Q.F32 else quantized(w, qtype, "router")), w


@pytest.mark.parametrize("router_type", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("normalize", [False, True], ids=["weights", "normalize"])
@pytest.mark.parametrize("tokens, k", [(1, 4), (37, 2), (300, 8)])
def test_routed_experts_route_as_torch_does(backend, isa, q4, router_type, normalize, tokens, k):
    """The experts torch's softmax and top-k choose from the same router logits, best first; the output within
    float32 rounding of moe_experts on torch's weights (the softmax's exps are std::exp's, not torch's)."""
    from churon.model.backend import softmax_top_k

    router, _ = make_router(backend, router_type, seed=61)
    h = hidden_states(tokens, seed=62)
    weights, chosen = softmax_top_k(backend.linear(router, h), k)
    want = backend.moe_experts(q4, h, chosen, weights, normalize)
    out = backend.routed_experts(router, q4, h, k, normalize)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6 * want.abs().max())
    # the same choices: the output changes far more than rounding when any token's experts or order differ
    swapped = backend.moe_experts(q4, h, chosen.flip(-1), weights, normalize)
    assert k == 1 or not torch.allclose(swapped, want, rtol=1e-5, atol=1e-6 * want.abs().max())


def test_routed_experts_a_token_s_bits_do_not_depend_on_its_batch(backend, experts, threads):
    router, _ = make_router(backend, Q.Q8_0, seed=63)
    h = hidden_states(40, seed=64)
    threads(2)
    batch = backend.routed_experts(router, experts, h, 4, True)
    threads(1)
    for t in (0, 17, 39):
        assert torch.equal(backend.routed_experts(router, experts, h[t:t + 1], 4, True)[0], batch[t])


def test_a_nan_row_fails_alone_in_routed_experts(backend, q4):
    # a request whose hidden state went NaN gets NaN out (its logits show the failure); the batch's others are unhurt
    router, _ = make_router(backend, Q.F32, seed=65)
    h = hidden_states(5, seed=66)
    h[2] = float("nan")
    out = backend.routed_experts(router, q4, h, 4, True)
    assert out[2].isnan().all()
    for t in (0, 1, 3, 4):
        assert torch.equal(out[t], backend.routed_experts(router, q4, h[t:t + 1], 4, True)[0])


def test_routed_experts_bad_inputs_are_value_errors(backend, q4):
    router, w = make_router(backend, Q.F32, seed=67)
    h = hidden_states(3, seed=68)
    with pytest.raises(ValueError, match=r"k must be in \[1, 8\], got 0"):
        backend.routed_experts(router, q4, h, 0)
    with pytest.raises(ValueError, match=r"k must be in \[1, 8\], got 9"):
        backend.routed_experts(router, q4, h, 9)
    with pytest.raises(ValueError, match=r"the router must be 8 x 256 \(experts x hidden\), got 7 x 256"):
        backend.routed_experts(backend.matrix(w[:7].contiguous()), q4, h, 2)
    with pytest.raises(ValueError, match=r"h must be \[tokens, 256\]"):
        backend.routed_experts(router, q4, torch.zeros(3, HIDDEN + 32), 2)
    assert backend.routed_experts(router, q4, torch.empty(0, HIDDEN), 2).shape == (0, HIDDEN)

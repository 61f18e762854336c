"""Update rules through SparseTable/DenseTable equal torch.optim (and FBGEMM's TBE) to 1e-6."""

import pytest
import torch

from recps.errors import ConfigError
from recps.ps.table import (
    AdagradRule,
    CountFilterEntry,
    AdamRule,
    DenseTable,
    Initializer,
    RowWiseAdagradRule,
    SGDRule,
    SparseTable,
    make_rule,
)

D = 8
KEYS = torch.tensor([5, -1, 2**62 + 9, 17, -(2**63), 42], dtype=torch.int64)
TOL = dict(atol=1e-6, rtol=1e-6)


def pushes(steps: int, seed: int = 0):
    """Batches with duplicate keys: (push_keys (K+3,), grads (K+3, D), summed grads (K, D))."""
    g = torch.Generator().manual_seed(seed)
    k = KEYS.numel()
    for _ in range(steps):
        pos = torch.cat([torch.arange(k), torch.tensor([0, 3, 3])])  # row 0 twice, row 3 three times
        perm = torch.randperm(pos.numel(), generator=g)
        pos = pos[perm]
        grads = torch.randn(pos.numel(), D, generator=g)
        summed = torch.zeros(k, D).index_add_(0, pos, grads)
        yield KEYS[pos], grads, summed


CASES = [
    (SGDRule(lr=0.1), lambda p: torch.optim.SGD([p], lr=0.1)),
    (SGDRule(lr=0.1, l2=0.01), lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=0.01)),
    (AdagradRule(lr=0.1), lambda p: torch.optim.Adagrad([p], lr=0.1)),
    (
        AdagradRule(lr=0.05, l2=0.02, initial_accumulator_value=0.1, eps=1e-6),
        lambda p: torch.optim.Adagrad([p], lr=0.05, weight_decay=0.02, initial_accumulator_value=0.1, eps=1e-6),
    ),
    (AdamRule(lr=0.01), lambda p: torch.optim.Adam([p], lr=0.01)),
    (
        AdamRule(lr=0.02, beta1=0.8, beta2=0.99, eps=1e-6, l2=0.01),
        lambda p: torch.optim.Adam([p], lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
    ),
]


@pytest.mark.parametrize("rule,make_torch", CASES, ids=lambda c: getattr(c, "name", ""))
def test_sparse_rule_equals_torch_optim(rule, make_torch):
    table = SparseTable(D, optimizer=rule, initializer=Initializer("normal", std=0.5), seed=3)
    param = torch.nn.Parameter(table.pull(KEYS).clone())
    opt = make_torch(param)
    for keys, grads, summed in pushes(6):
        assert table.push(keys, grads) == KEYS.numel()
        param.grad = summed
        opt.step()
        torch.testing.assert_close(table.pull(KEYS), param.detach(), **TOL)
    state = table.state(KEYS)
    if isinstance(rule, AdagradRule):
        torch.testing.assert_close(state, opt.state[param]["sum"], **TOL)
    if isinstance(rule, AdamRule):
        torch.testing.assert_close(state[:, :D], opt.state[param]["exp_avg"], **TOL)
        torch.testing.assert_close(state[:, D : 2 * D], opt.state[param]["exp_avg_sq"], **TOL)
        assert state[:, 2 * D].eq(6).all()


COMPILED = [
    SGDRule(lr=0.1),
    SGDRule(lr=0.1, l2=0.01, bounds=(-0.4, 0.4)),
    AdagradRule(lr=0.1, initial_accumulator_value=0.1),
    AdagradRule(lr=0.05, l2=0.02, eps=1e-6),
    RowWiseAdagradRule(lr=0.1),
    RowWiseAdagradRule(lr=0.2, l2=0.05, eps=1e-6, initial_accumulator_value=0.5, bounds=(-0.3, 0.3)),
]


@pytest.mark.parametrize("rule", COMPILED, ids=lambda r: f"{r.name}-l2{r.l2}-{r.bounds}")
def test_compiled_push_of_unique_keys_equals_the_torch_rule(rule):
    """push(unique=True) (one compiled pass) == push() (group, rule in torch ops) on values and state,
    including keys first seen in the push and GEO deltas."""
    tables = [SparseTable(D, optimizer=rule, initializer=Initializer("normal", std=0.5), seed=3) for _ in range(2)]
    g = torch.Generator().manual_seed(4)
    seen = KEYS[:4]
    for t in tables:
        t.pull(seen)
    for step in range(6):
        keys = KEYS[torch.randperm(KEYS.numel(), generator=g)[:5]]  # distinct; some never pulled
        grads = torch.randn(keys.numel(), D, generator=g)
        assert tables[0].push(keys, grads, unique=True) == tables[1].push(keys, grads) == 5
        if step % 2:
            deltas = torch.randn(keys.numel(), D, generator=g)
            assert tables[0].push_delta(keys, deltas, unique=True) == tables[1].push_delta(keys, deltas) == 5
    torch.testing.assert_close(tables[0].pull(KEYS), tables[1].pull(KEYS), **TOL)
    torch.testing.assert_close(tables[0].state(KEYS), tables[1].state(KEYS), **TOL)
    assert len(tables[0]) == len(tables[1]) == KEYS.numel()


def test_compiled_push_skips_keys_the_entry_policy_did_not_admit():
    table = SparseTable(D, optimizer=RowWiseAdagradRule(lr=0.1), initializer=Initializer("zeros"),
                        entry=CountFilterEntry(count=2))
    table.pull(KEYS[:2])
    table.pull(KEYS[:1])  # KEYS[0] seen twice: admitted; KEYS[1] once: not yet
    assert table.push(KEYS[:3], torch.ones(3, D), unique=True) == 1
    rows = table.pull(KEYS[:3], create=False)
    torch.testing.assert_close(rows[0], torch.full((D,), -0.1))  # lr / sqrt(mean g^2 = 1)
    assert rows[1:].eq(0).all() and len(table) == 1


def test_adam_step_count_is_per_row():
    """Rows pushed at different steps each follow their own torch Adam."""
    rule = AdamRule(lr=0.05)
    table = SparseTable(D, optimizer=rule, initializer=Initializer("uniform", low=-1, high=1), seed=1)
    params = [torch.nn.Parameter(row.clone()) for row in table.pull(KEYS)]
    opts = [torch.optim.Adam([p], lr=0.05) for p in params]
    g = torch.Generator().manual_seed(5)
    for step in range(7):
        chosen = torch.nonzero(torch.rand(KEYS.numel(), generator=g) < 0.5).squeeze(1)
        grads = torch.randn(chosen.numel(), D, generator=g)
        table.push(KEYS[chosen], grads)
        for i, grad in zip(chosen.tolist(), grads):
            params[i].grad = grad.clone()
            opts[i].step()
    expect = torch.stack([p.detach() for p in params])
    torch.testing.assert_close(table.pull(KEYS), expect, **TOL)
    steps = torch.tensor([float(opts[i].state[params[i]].get("step", 0)) for i in range(KEYS.numel())])
    assert torch.equal(table.state(KEYS)[:, 2 * D], steps)


def test_rowwise_adagrad_equals_fbgemm_exact_rowwise_adagrad():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    rows = KEYS.numel()
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, D, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.1,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    table = SparseTable(D, optimizer=RowWiseAdagradRule(lr=0.1, eps=1e-8), initializer=Initializer("normal", std=0.3))
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(table.pull(KEYS))
    key_to_row = {k: i for i, k in enumerate(KEYS.tolist())}
    for keys, grads, _ in pushes(5, seed=2):
        table.push(keys, grads)
        indices = torch.tensor([key_to_row[k] for k in keys.tolist()])
        out = tbe(indices, torch.arange(indices.numel() + 1))  # one index per bag: gradient = grads row
        out.backward(grads)
    torch.testing.assert_close(table.pull(KEYS), tbe.split_embedding_weights()[0].detach(), **TOL)
    torch.testing.assert_close(table.state(KEYS)[:, 0], tbe.split_optimizer_states()[0][0], **TOL)


def test_rowwise_adagrad_definition_with_l2():
    rule = RowWiseAdagradRule(lr=0.2, l2=0.1, eps=1e-8)
    w = torch.tensor([[1.0, -2.0, 3.0]])
    g = torch.tensor([[0.5, 0.5, -1.0]])
    state = rule.init_state(1, 3)
    rule.apply(w, g, state)
    g2 = g + 0.1 * torch.tensor([[1.0, -2.0, 3.0]])
    s = (g2**2).mean()
    assert state.item() == pytest.approx(s.item(), rel=1e-6)
    torch.testing.assert_close(w, torch.tensor([[1.0, -2.0, 3.0]]) - 0.2 * g2 / (s.sqrt() + 1e-8), **TOL)


def test_weight_bounds_clamp_after_update():
    table = SparseTable(2, optimizer=SGDRule(lr=1.0, bounds=(-0.5, 0.25)), initializer=Initializer("zeros"))
    keys = torch.tensor([1, 2])
    table.push(keys, torch.tensor([[10.0, -10.0], [0.1, -0.1]]))
    assert table.pull(keys).tolist() == [[-0.5, 0.25], [pytest.approx(-0.1), pytest.approx(0.1)]]


def test_fp16_storage_uses_fp32_arithmetic():
    rule = AdagradRule(lr=0.1)
    t32 = SparseTable(D, optimizer=rule, dtype=torch.float32, seed=4)
    t16 = SparseTable(D, optimizer=rule, dtype=torch.float16, seed=4)
    for keys, grads, _ in pushes(3):
        t32.push(keys, grads)
        t16.push(keys, grads)
    # Same state (fp32) up to the effect of fp16 rounding of the stored values.
    torch.testing.assert_close(t16.state(KEYS), t32.state(KEYS))
    torch.testing.assert_close(t16.pull(KEYS), t32.pull(KEYS), atol=1e-3, rtol=1e-3)
    assert torch.equal(t16.pull(KEYS), t16.pull(KEYS).half().float())


def push_both(table: DenseTable, params, opt, g: torch.Generator, steps: int, bounds=None) -> None:
    """`steps` random gradients pushed to the table and stepped by `opt` on `params` (then clamped
    to `bounds`, as the table's rule does)."""
    for _ in range(steps):
        grads = {n: torch.randn(shape, generator=g) for n, shape in table.shapes().items()}
        table.push(grads)
        for p, grad in zip(params, grads.values()):
            p.grad = grad
        opt.step()
        if bounds is not None:
            with torch.no_grad():
                for p in params:
                    p.clamp_(*bounds)


@pytest.mark.parametrize("rule,make_torch", CASES[::2], ids=lambda c: getattr(c, "name", ""))
def test_dense_rule_equals_torch_optim(rule, make_torch):
    g = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "s": torch.tensor(0.5)}
    table = DenseTable(init, optimizer=rule)
    params = [torch.nn.Parameter(v.clone()) for v in init.values()]
    opt = make_torch(params[0])
    opt.add_param_group({"params": params[1:]})
    push_both(table, params, opt, g, steps=4)
    for (n, v), p in zip(table.pull().items(), params):
        torch.testing.assert_close(v, p.detach(), **TOL)


def test_rule_config_errors():
    with pytest.raises(ConfigError, match="lr=0"):
        SGDRule(lr=0)
    with pytest.raises(ConfigError, match="bounds"):
        SGDRule(bounds=(1.0, -1.0))
    with pytest.raises(ConfigError, match="beta1=1.0"):
        AdamRule(beta1=1.0)
    with pytest.raises(ConfigError, match="'adamw' is unknown"):
        make_rule("adamw")
    assert make_rule("rowwise_adagrad", lr=0.3, bounds=[-1, 1]) == RowWiseAdagradRule(lr=0.3, bounds=(-1.0, 1.0))


def test_dense_adam_with_bounds_clamps_after_each_fused_step():
    """The fused one-row Adam path of a dense table clamps as torch Adam + clamp_ would."""
    g = torch.Generator().manual_seed(1)
    init = {"w": torch.randn(5, 4, generator=g) * 0.05, "b": torch.zeros(4)}
    table = DenseTable(init, optimizer=AdamRule(lr=0.03, bounds=(-0.06, 0.06)))
    params = [torch.nn.Parameter(v.clone()) for v in init.values()]
    opt = torch.optim.Adam(params, lr=0.03)
    push_both(table, params, opt, g, steps=5, bounds=(-0.06, 0.06))
    values = table.pull()
    assert values["w"].abs().max() == pytest.approx(0.06)  # some weights hit the bound
    for v, p in zip(values.values(), params):
        torch.testing.assert_close(v, p.detach(), **TOL)

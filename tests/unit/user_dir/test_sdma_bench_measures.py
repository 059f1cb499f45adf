"""The measures behind ``make bench``: interleaved update timing and the base-configuration memory table."""

import pytest
import torch

from benchmarks.op_counts import count_traffic
from latent_core.sdma import SDMACore
from benchmarks.sdma import profile_update, scale, step_timing


def test_saved_activation_bytes_counts_each_saved_storage_once_and_no_parameters():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def forward():
        h = x @ weight  # saves x (128 B) and the weight (excluded)
        return (h * h).sum()  # saves h twice: one storage (128 B)

    assert scale.saved_activation_bytes(forward, [weight]) == 2 * 4 * 8 * 4


def test_update_timing_interleaves_rounds_and_reports_ratios_to_vanilla():
    setting = step_timing.StepSetting(sentences=4, tokens=5, vocab=50, rounds=2, updates_per_round=1)
    timing = step_timing.time_updates("tiny2x2", setting)
    models = timing["models"]
    assert list(models) == ["V-T", "SMA-T", "SDMA-T"]
    for name, r in models.items():
        assert len(r["wall_ms"]) == len(r["cpu_ms"]) == 2 and min(r["wall_ms"]) > 0
        assert r["speed_ratio"]["min"] <= r["speed_ratio"]["median"] <= r["speed_ratio"]["max"]
    assert models["V-T"]["speed_ratio"] == {"min": 1.0, "median": 1.0, "max": 1.0, "median_ci95": None}  # 2 rounds
    assert models["V-T"]["fastest_ratio"] == 1.0 and models["SDMA-T"]["fastest_ratio"] > 0
    # SDMA-T adds the GMM products and the semantic mask: more arithmetic than SMA-T, than V-T
    assert 1.0 < models["SMA-T"]["flops_ratio"] < models["SDMA-T"]["flops_ratio"] < 1.2
    assert models["SDMA-T"]["params"] > models["V-T"]["params"]
    # and more elementwise work: the GMMs, the mask, the regularisers
    assert 1.0 < models["SMA-T"]["elementwise_bytes_ratio"] < models["SDMA-T"]["elementwise_bytes_ratio"]
    assert models["V-T"]["elementwise_ops"] < models["SMA-T"]["elementwise_ops"] < models["SDMA-T"]["elementwise_ops"]
    rows = step_timing.table_rows(timing)
    assert [r["model"] for r in rows] == ["V-T", "SMA-T", "SDMA-T"]
    assert {r["reading"] for r in rows} == {"authors"}


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_update_timing_builds_the_reading_it_is_given(reading):
    setting = step_timing.StepSetting(sentences=2, tokens=4, vocab=50, reading=reading)
    model = step_timing.build_for_updates("tiny2x2", "sdma", setting)[0]
    readings = {m.options.reading for m in model.modules() if isinstance(m, SDMACore)}
    assert readings == {reading}


def test_traffic_counter_counts_elementwise_bytes_once_and_skips_views_and_matmuls():
    a, b = torch.randn(16, 8), torch.randn(8, 4)

    def work():
        h = a @ b  # a matrix product: not elementwise
        h = h.t().contiguous()  # a view (free) then a copy: reads and writes 64 floats
        h.mul_(2.0)  # in place: its one tensor counted once
        return torch.zeros_like(h)  # a factory: writes only

    counts = count_traffic(work)
    assert counts["matmul_ops"] == 1
    assert counts["ops"] == 3
    assert counts["bytes"] == (2 * 64 + 64 + 64) * 4


def _launch_counter_example():
    """``(f, update)``: ``f(x, w)`` a softmax of a product; ``update(fn)`` runs ``fn(x, w)`` forward and backward,
    the gradients reset first (as after ``zero_grad(set_to_none=True)``)."""
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)

    def f(x, w):
        return torch.softmax(x @ w, -1).exp().sum(-1) * 2

    def update(fn):
        x.grad = w.grad = None
        fn(x, w).sum().backward()

    return f, update


def test_launch_counter_agrees_with_the_dispatch_count_eager():
    """count_launches, eager: the ops a dispatch-mode counter sees (elementwise + matrix products, no views or
    allocations)."""
    from benchmarks.op_counts import count_launches

    f, update = _launch_counter_example()
    traffic = count_traffic(lambda: update(f))
    assert count_launches(lambda: update(f)) == {"aten": traffic["ops"] + traffic["matmul_ops"], "inductor": 0,
                                                 "launches": traffic["ops"] + traffic["matmul_ops"]}


def test_launches_by_source_follow_their_autograd_nodes_into_backward():
    """Each launch counts where it ran: inside a source range, or (backward) where the op that made its autograd
    node ran; a custom Function's backward counts with its forward."""
    from benchmarks.op_counts import count_launches
    from latent_core.profiling import host_range, source_range

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    x = torch.randn(4, 4, requires_grad=True)

    def step():
        with source_range("noise"):
            y = x + torch.randn(4, 4)  # randn, add; backward: nothing (add passes the gradient on)
            with host_range("seed"):  # a CPU generator's draw: no launch on a GPU, none counted
                seed = int(torch.randint(0, 9, (1,)).item())
            y = y + seed  # add
        with source_range("mixture"):
            y = Double.apply(y).exp()  # mul, exp; backward: mul, mul
        y.sin().sum().backward()  # sin, sum, the seed's fill; backward: cos, mul, the expand of sum (a view)

    counted = count_launches(step, by_source=True)
    assert counted["by_source"] == {"noise": 3, "mixture": 4, "other": 5}
    assert sum(counted["by_source"].values()) == counted["launches"]
    assert "by_source" not in count_launches(step)


@pytest.mark.integration  # inductor compiles C++: minutes on a cold cache, out of the unit tier
def test_launch_counter_sees_inductors_kernels_compiled():
    """count_launches of a ``torch.compile``'d function: the extern matrix products plus the fused kernels
    inductor generated, fewer launches than eager."""
    import torch._inductor.config as inductor_config

    from benchmarks.op_counts import count_launches

    f, update = _launch_counter_example()
    eager = count_launches(lambda: update(f))
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        compiled = torch.compile(f, dynamic=True, fullgraph=True)
        update(compiled)
        fused = count_launches(lambda: update(compiled))
    assert fused["inductor"] >= 2  # at least one fused kernel forward and one backward
    assert fused["launches"] < eager["launches"]
    assert fused["aten"] >= 3  # the three matrix products stay ATen (extern) kernels


def test_update_timing_refuses_impossible_settings():
    with pytest.raises(ValueError, match="rounds=0"):
        step_timing.StepSetting(rounds=0).validate()
    with pytest.raises(ValueError, match="reading='table'"):
        step_timing.StepSetting(reading="table").validate()
    with pytest.raises(ValueError, match="unknown configuration 'huge'"):
        step_timing.time_updates("huge")


@pytest.mark.integration  # profiles three fairseq models' training update (gpu-check's profile step)
def test_update_profile_counts_ops_and_names_the_costliest():
    """gpu-check's profile step, run on the CPU (the kernel columns exist only on CUDA)."""
    setting = step_timing.StepSetting(sentences=4, tokens=5, vocab=50)
    report = profile_update.profile_updates("tiny2x2", setting, "cpu", updates=1, warmup=0,
                                            models=["V-T", "SMA-T", "SDMA-T"])
    models = report["models"]
    assert list(models) == ["V-T", "SMA-T", "SDMA-T"] and report["device"] == "cpu"
    assert models["V-T"]["speed_vs_vt"] == 1.0 and models["V-T"]["aten_ops_vs_vt"] == 1.0
    assert models["V-T"]["aten_ops"] < models["SMA-T"]["aten_ops"] < models["SDMA-T"]["aten_ops"]
    assert models["V-T"]["launches"] < models["SMA-T"]["launches"] < models["SDMA-T"]["launches"]
    for r in models.values():  # eager: no inductor kernels; the dispatch count also counts allocations
        assert 0.5 * r["aten_ops"] < r["launches"] <= r["aten_ops"] and r["triton_kernels"] == 0
        assert r["launches"] == r["model_launches"] + r["optimizer_launches"]
    for r in models.values():
        assert r["ms_per_update"] > 0 and "kernels" not in r
        assert r["top_ops"] and all(op["name"].startswith("aten::") for op in r["top_ops"])
    assert [row["model"] for row in profile_update.table_rows(report)] == ["V-T", "SMA-T", "SDMA-T"]
    for r in models.values():  # every launch of the forward + backward attributed to one source; the first forward
        # of the process (warmup=0) launches 3 more for lazy initialisation than the recount
        assert 0 <= r["model_launches"] - sum(r["sources"]["total"].values()) <= 3 and r["sources"]["modules"] == 6
    vanilla, sdma = models["V-T"]["sources"]["total"], models["SDMA-T"]["sources"]["total"]
    assert vanilla["clustering"] == vanilla["mixture"] == vanilla["noise"] == 0 and vanilla["attention"] > 0
    assert sdma["clustering"] > 0 and sdma["mixture"] > 0 and sdma["noise"] > 0


@pytest.mark.interpreter
def test_a_triton_variant_is_counted_in_the_interpreter_each_kernel_one_launch():
    """``SDMA-T triton`` on a CPU: counted untimed in Triton's interpreter, its Triton kernels among its launches,
    against V-T on the same batch."""
    setting = step_timing.StepSetting(sentences=4, tokens=5, vocab=50)
    report = profile_update.profile_updates("tiny2x2", setting, "cpu", updates=1, warmup=0,
                                            models=["V-T", "SDMA-T", "SDMA-T triton"])
    eager, triton = report["models"]["SDMA-T"], report["models"]["SDMA-T triton"]
    assert triton["interpreted"] and "ms_per_update" not in triton and triton["count_batch"] == [2, 5]
    assert triton["model_launches_vs_vt"] == triton["model_launches"] / triton["vt_model_launches_same_batch"]
    modules = 2 * 2 + 2  # 2 encoder self-attentions, 2 decoder layers of self- and cross-attention
    # z and q clustering (1 + 2 kernels each) and the mixture (1 + 3) in every module, plus the weights kernel in the
    # last decoder layer's cross-attention, whose weights fairseq's decoder asks for (its alignment layer);
    # per attention type the regularisers: eq. (20) and (23) of the z and q GMMs (1 + 2 each) and, in the authors'
    # cross-attention, of the keys (1 + 2); eq. (21) and (22) (2 + 1)
    attention_types, cross_attention_types = 3, 1
    regularisers = attention_types * (2 * 3 + 3) + cross_attention_types * 3
    # eq. (8)'s noise, one kernel a draw: x and the queries in every module and, in the authors' reading, the cross-
    # attentions' keys (no kernel in backward)
    noise = modules * 2 + 2
    assert triton["triton_kernels"] == modules * 2 * 3 + modules * 4 + 1 + regularisers + noise
    assert triton["model_launches"] < eager["model_launches"]
    rows = profile_update.table_rows(report)
    assert rows[-1]["ms/update"] is None and rows[-1]["fwd+bwd launches"] == triton["model_launches"]


def test_update_profile_refuses_impossible_settings():
    with pytest.raises(ValueError, match="updates=0"):
        profile_update.profile_updates("tiny2x2", step_timing.StepSetting(), updates=0)
    with pytest.raises(ValueError, match="unknown configuration 'huge'"):
        profile_update.profile_updates("huge", step_timing.StepSetting())

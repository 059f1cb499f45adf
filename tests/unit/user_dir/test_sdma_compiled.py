"""The compiled path (``--sdma-compile``): the same training computation as eager, one graph per function,
no recompilation for new lengths (inductor's C++ backend on the CPU).

Inductor draws random numbers with its own generator; ``fallback_random`` makes it call eager's, so the
sampling noise of eq. (8) and dropout are the same numbers and compiled == eager can be tested on the
real training computation (noise and dropout on)."""

import copy

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

from latent_core.sdma import compile_seconds
from tests.unit.user_dir.test_sdma_fairseq import build, criterion_sample

LENGTHS = [(7, 6), (9, 5), (4, 8), (12, 10), (5, 3), (8, 11), (6, 4), (10, 7), (3, 9), (11, 12)]
LOGGED = ("loss", "nll_loss", "sdma_kl_z", "sdma_kl_q", "sdma_dqq", "sdma_dxq", "sdma_dv_z", "sdma_dv_q")


def padded_batch(task, src_len, tgt_len, bsz=3, seed=0):
    """A batch with a left-padded source row and a right-padded target row (fairseq's layouts)."""
    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    src = torch.randint(d.nspecial, len(d), (bsz, src_len), generator=g)
    src[0, :2] = d.pad()
    prev = torch.cat([torch.full((bsz, 1), d.eos()), torch.randint(d.nspecial, len(d), (bsz, tgt_len - 1),
                                                                     generator=g)], 1)
    sample = criterion_sample(task, src, src.ne(d.pad()).sum(1), prev)
    sample["target"][1, -2:] = d.pad()
    sample["net_input"]["prev_output_tokens"][1, -1:] = d.pad()
    sample["ntokens"] = int(sample["target"].ne(d.pad()).sum())
    return sample


def update(model, criterion, sample, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss, _, log = criterion(model, sample)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {name: float(log[name]) for name in LOGGED}, grads


@pytest.fixture(scope="module", params=["authors", "paper"])
def runs(request, tmp_path_factory):
    """Eager and compiled models from the same weights, trained side by side on ten batches of different
    lengths (attention dropout and the sampling noise on): their logs, gradients and compilation counts."""
    torch._dynamo.reset()
    counters.clear()
    tmp_path = tmp_path_factory.mktemp(request.param)
    extra = ["--sdma-reading", request.param, "--attention-dropout", "0.1", "--dropout", "0.1"]
    eager, task, args = build(tmp_path, *extra)
    compiled, _, compiled_args = build(tmp_path, *extra, "--sdma-compile")
    compiled.load_state_dict(eager.state_dict())
    criterion = task.build_criterion(args)
    steps = []
    graphs = []
    with inductor_config.patch(fallback_random=True):
        for step, (src_len, tgt_len) in enumerate(LENGTHS):
            sample = padded_batch(task, src_len, tgt_len, seed=step)
            for model in (eager, compiled):
                model.train()
                model.set_num_updates(500 * step)
            steps.append((update(eager, criterion, sample, step), update(compiled, criterion, sample, step)))
            graphs.append(counters["stats"]["unique_graphs"])
    return {"steps": steps, "graphs": graphs, "breaks": dict(counters["graph_break"]), "args": compiled_args,
            "eager": eager, "compiled": compiled, "task": task}


def test_option_reaches_every_sdma_module(runs):
    assert runs["args"].sdma_compile
    cores = [m for m in runs["compiled"].modules() if hasattr(m, "options") and hasattr(m, "mix_weight")]
    assert len(cores) == 6 and all(core.options.compile for core in cores)


def test_compiled_losses_and_logged_terms_equal_eager(runs):
    for step, ((eager_log, _), (compiled_log, _)) in enumerate(runs["steps"]):
        for name in LOGGED:
            assert compiled_log[name] == pytest.approx(eager_log[name], rel=1e-4, abs=1e-5), (step, name)


def test_compiled_gradients_equal_eager(runs):
    for step, ((_, eager_grads), (_, compiled_grads)) in enumerate(runs["steps"]):
        assert compiled_grads.keys() == eager_grads.keys()
        # a gradient that is zero up to rounding (the keys' bias: softmax ignores a shift of every score)
        # is compared against the largest gradient of the update
        largest = max(float(grad.abs().max()) for grad in eager_grads.values())
        for name, grad in eager_grads.items():
            scale = max(float(grad.abs().max()), 1e-3 * largest)
            error = float((compiled_grads[name] - grad).abs().max()) / scale
            assert error < 1e-3, f"batch {step}: {name} differs by {error:.2e} of its largest entry"


def test_one_graph_per_function_and_no_recompilation_for_new_lengths(runs):
    """fullgraph=True turns a graph break into an error; dynamo's counters say none happened. The first batch
    compiles one graph per variant of the attention's forward (encoder self, decoder self, cross-attention,
    and the last layer's cross-attention, whose weights fairseq's decoder returns) and of the regularisers
    (with and without the cross-attention keys' terms in the authors reading); they serve all ten batches."""
    assert runs["breaks"] == {}
    first, last = runs["graphs"][0], runs["graphs"][-1]
    assert 0 < first <= 6
    assert last == first, f"{last - first} recompilations over {len(LENGTHS)} batches of new lengths"
    assert compile_seconds() > 0


def test_eval_and_decoding_stay_eager(runs):
    """Validation and beam search run the eager modules: no graph is compiled for them."""
    from fairseq.sequence_generator import SequenceGenerator

    task, model = runs["task"], runs["compiled"]
    before = counters["stats"]["unique_graphs"]
    model.eval()
    sample = padded_batch(task, 6, 5)
    with torch.no_grad():
        hypos = SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_b=5).generate(
            [model], sample)
    assert len(hypos) == 3
    assert counters["stats"]["unique_graphs"] == before

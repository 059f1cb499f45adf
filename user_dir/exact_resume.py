"""Bit-identical resume of ``fairseq-train``: a cached epoch iterator is always built as at epoch 1.

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

**The fix**: every process makes a split's cached batches as the continuous run did, under
``seed + 1``, whatever epoch it starts at. :func:`batches_made_as_at_epoch_one` wraps
``get_batch_iterator``: when fairseq is about to build and cache a new iterator for epoch k > 1
(the resume case), it builds it for epoch 1 and then moves it to epoch k (``EpochBatchIterator.epoch``,
``dataset.set_epoch(k)``); the checkpoint's ``load_state_dict`` then restores epoch and offset, and
``ordered_batches`` shuffles with ``seed + k`` as in the continuous run. Where fairseq does not cache
(``--update-epoch-batch-itr``, ``--rebuild-batches``, sharded data, datasets that change per epoch)
it already makes each epoch's batches under ``seed + epoch`` in every process, and nothing is changed.
Applied

* in the plugin's own tasks (``sentence_vae`` and its ``optimus_lm``, ``hf_sentence_prediction``
  and its ``topic_vq_sentence_prediction``), which wrap their ``get_batch_iterator``;
* to fairseq's ``translation`` task (SDMA translation, the plain transformer baselines) by
  :func:`patch_fairseq_tasks` at ``import user_dir`` (subclasses that do not override
  ``get_batch_iterator`` follow).

A patch at import rather than an option because ``fairseq-train`` is called from many places
(recipes, ``scripts/*.py``, the tests, by hand): an option would have to be remembered in all of
them and a forgotten one fails silently, while every one of them passes ``--user-dir user_dir``.

**What loading the plugin changes for fairseq's own models** (``--arch transformer`` with
``--user-dir user_dir``): nothing in a continuous run: it builds its batches at epoch 1 as before, so
its batches, losses and parameters are bit-identical to a run without the plugin, at the same speed
(tested: ``tests/integration/test_exact_resume.py``). A run resumed at epoch k > 1 gets the batches
of the continuous run instead of a new partition (fairseq's own behaviour there is the defect above).

An earlier version of this fix made every epoch rebuild its iterator (``can_reuse_epoch_itr``
False, like ``--update-epoch-batch-itr``). That is exact too but changes a continuous run's batches
from epoch 2 on, and each discarded iterator's persistent data-loader worker (fairseq's default
``--num-workers 1``) took about 5 s to shut down: a tiny transformer ran 3x slower with the plugin
loaded. Building as at epoch 1 makes nothing per epoch.

ESPnet needs no fix: it reseeds everything at each epoch (``set_all_random_seed(seed + iepoch)``)
and its batch sampler derives the order from the epoch, so its epoch-boundary ``--resume`` is
already exact (tested too). Exactness is on one machine with the same software and thread count;
it is not a claim about different hardware or library versions.
"""

import functools
import inspect

from fairseq.tasks.translation import TranslationTask

__all__ = ["batches_made_as_at_epoch_one", "patch_fairseq_tasks"]


def batches_made_as_at_epoch_one(get_batch_iterator):
    """Wrap a task's ``get_batch_iterator`` (``FairseqTask``'s signature) so that an iterator that
    fairseq caches is always built with epoch 1's batches (module docstring); idempotent."""
    if getattr(get_batch_iterator, "exact_resume", False):
        return get_batch_iterator
    signature = inspect.signature(get_batch_iterator)

    @functools.wraps(get_batch_iterator)
    def wrapper(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        task, dataset, epoch = call.arguments["self"], call.arguments["dataset"], call.arguments["epoch"]
        cached = (not call.arguments["disable_iterator_cache"] and not call.arguments["update_epoch_batch_itr"]
                  and not getattr(task.cfg, "rebuild_batches", False) and task.can_reuse_epoch_itr(dataset))
        if epoch <= 1 or not cached or dataset in task.dataset_to_epoch_iter:
            return get_batch_iterator(*call.args, **call.kwargs)
        call.arguments["epoch"] = 1
        iterator = get_batch_iterator(*call.args, **call.kwargs)
        iterator.epoch = epoch  # what EpochBatchIterator(epoch=epoch) sets; load_state_dict restores it too
        dataset.set_epoch(epoch)
        return iterator

    wrapper.exact_resume = True  # marks the patch (idempotence, tests)
    return wrapper


PATCHED_TASKS = (TranslationTask,)


def patch_fairseq_tasks() -> None:
    """Make fairseq's own tasks that the plugin trains with build their cached batch iterator
    with epoch 1's batches (idempotent)."""
    for cls in PATCHED_TASKS:
        cls.get_batch_iterator = batches_made_as_at_epoch_one(cls.get_batch_iterator)

"""ddl_triton.tensorflow.elastic in one process: TensorFlowKerasState's commit, restore and byte
transfer (raw bytes and a JSON manifest, checked against the receiver's own variables), its
refusals, and Horovod's two elastic callbacks' semantics. The multi-rank drill is
tests/multirank/test_elastic_tf_one_host.py.

Not collected by the suite itself: test_elastic_tf.py runs this file under pytest in a process of
its own, because TensorFlow loaded into the suite's process makes a later Triton load there abort
(LLVM's command-line options registered twice: docs/tensorflow.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tensorflow")
import torch  # noqa: E402

import ddl_triton.tensorflow  # noqa: E402,F401 - before keras (it loads what must come first)
import keras  # noqa: E402

from ddl_triton.elastic import state as floor_state  # noqa: E402
from ddl_triton.errors import DDLError  # noqa: E402
from ddl_triton.tensorflow import elastic  # noqa: E402


def _model(seed: int, hidden: int = 4):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(hidden), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def _bits(state) -> list[bytes]:
    return [np.asarray(v.numpy()).tobytes() for v in state._variables()]


def test_restore_and_the_bytes_and_manifest_round_trip():
    source_model = _model(1)
    x, y = np.arange(12, dtype=np.float32).reshape(4, 3), np.ones((4, 1), np.float32)
    source = elastic.TensorFlowKerasState(source_model, epoch=2)
    source_model.fit(x, y, epochs=1, verbose=0)  # the optimizer's momentum and iterations move
    source.save()
    committed = _bits(source)
    source_model.fit(x, y, epochs=1, verbose=0)
    assert _bits(source) != committed
    source.restore()
    assert _bits(source) == committed
    tensors, manifest = source._packed()
    assert json.loads(json.dumps(manifest)) == manifest and manifest["counters"] == {"epoch": 2}
    flat = torch.empty(manifest["nbytes"], dtype=torch.uint8)
    floor_state._pack(tensors, flat)
    joiner = elastic.TensorFlowKerasState(_model(7), epoch=0)  # built, never trained: optimizer built here
    received = joiner._receiving(manifest, rank=1, source=0)
    floor_state._unpack(flat, received)
    joiner._load(manifest, received)
    assert _bits(joiner) == committed and joiner.epoch == 2


def test_a_joiner_with_another_model_and_bad_states_are_refused():
    _, manifest = elastic.TensorFlowKerasState(_model(1))._packed()
    with pytest.raises(DDLError, match=r"rank 2: elastic: this rank's model and optimizer differ from rank 0's: "
                                       r"\S+kernel float32\[3, 5\] here, \S+kernel float32\[3, 4\] there"):
        elastic.TensorFlowKerasState(_model(1, hidden=5))._receiving(manifest, rank=2, source=0)
    with pytest.raises(ValueError, match="backend= is Horovod's Keras 2 session backend"):
        elastic.TensorFlowKerasState(_model(1), backend=object())
    with pytest.raises(TypeError, match="model must be a keras.Model"):
        elastic.TensorFlowKerasState("model")
    with pytest.raises(ValueError, match="reserved"):
        elastic.TensorFlowKerasState(_model(1), commits=0)


class _Counting:
    def __init__(self):
        self.commits, self.epoch = 0, 3

    def commit(self):
        self.commits += 1


def test_the_callbacks_keep_horovods_semantics():
    state = _Counting()
    commit = elastic.CommitStateCallback(state, batches_per_commit=2)
    commit.on_train_begin()
    for b in range(5):
        commit.on_train_batch_end(b)
    assert state.commits == 2  # after batches 2 and 4
    commit.on_epoch_end(0)
    assert state.commits == 3  # and at the epoch's end
    epochs = elastic.UpdateEpochStateCallback(state)
    epochs.on_train_begin()
    epochs.on_epoch_end(0)
    epochs.on_epoch_end(1)
    assert state.epoch == 5  # 3 done before this fit, then its epochs 0 and 1
    with pytest.raises(ValueError, match="batches_per_commit must be an int >= 1"):
        elastic.CommitStateCallback(state, batches_per_commit=0)

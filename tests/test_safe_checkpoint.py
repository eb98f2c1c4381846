"""The DeepSpeed checkpoint engine stores nested state without pickle, and refuses what would need it."""
import enum
from collections import OrderedDict

import pytest
import torch

from hpcrl.trainer.safe_checkpoint import UnsupportedCheckpointValue, load_tree, save_tree


class Stage(enum.Enum):
    TWO = 2


def test_roundtrip_of_deepspeed_like_state(tmp_path):
    t = torch.arange(6.0).reshape(2, 3)
    state = {"module": OrderedDict(w=t, b=torch.zeros(2, dtype=torch.bfloat16)),
             "optimizer": {"state": {0: {"exp_avg": t * 2, "step": 3}}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
             "shapes": [OrderedDict(w=torch.Size([2, 3]))], "zero_stage": Stage.TWO, "tuple": (1, "x", None),
             "nan": float("nan"), "dtype": torch.float32, "client": {"cursor": {"w000": {"line": 2, "row": 1}}}}
    save_tree(state, str(tmp_path / "ck"))
    got = load_tree(str(tmp_path / "ck"))
    torch.testing.assert_close(got["module"]["w"], t)
    assert got["module"]["b"].dtype == torch.bfloat16 and isinstance(got["module"], OrderedDict)
    assert got["optimizer"]["state"][0]["step"] == 3 and 0 in got["optimizer"]["state"]
    torch.testing.assert_close(got["optimizer"]["state"][0]["exp_avg"], t * 2)
    assert got["shapes"][0]["w"] == torch.Size([2, 3])
    assert got["zero_stage"] == 2 and got["tuple"] == (1, "x", None) and got["dtype"] is torch.float32
    assert got["nan"] != got["nan"]
    assert got["client"]["cursor"]["w000"] == {"line": 2, "row": 1}


def test_arbitrary_objects_are_refused(tmp_path):
    class Thing:
        pass

    with pytest.raises(UnsupportedCheckpointValue, match="Thing"):
        save_tree({"x": [Thing()]}, str(tmp_path / "ck"))


def test_file_is_safetensors_not_pickle(tmp_path):
    save_tree({"a": torch.ones(2)}, str(tmp_path / "ck"))
    head = (tmp_path / "ck").read_bytes()[:16]
    assert not head.startswith(b"PK") and not head.startswith(b"\x80")  # neither zip nor pickle protocol


def test_deepspeed_loss_scaler_roundtrips_through_the_allowlist(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"loss_scaler": LossScaler(scale=4.0), "param_slice_mappings": [{"w": fragment_address(numel=6, start=2)}]}
    save_tree(state, str(tmp_path / "ck"))
    got = load_tree(str(tmp_path / "ck"))
    assert type(got["loss_scaler"]) is LossScaler and got["loss_scaler"].cur_scale == 4.0
    assert got["param_slice_mappings"][0]["w"] == fragment_address(numel=6, start=2)

"""State dicts of sharded models: the model's (``_model``) and the optimizer's (``_optim``)."""

from fshard._state_dict._common import LoadResult
from fshard._state_dict._model import full_state_dict, layout_of, load_state_dict, state_dict
from fshard._state_dict._optim import load_optim_state_dict, optim_state_dict

__all__ = [
    "LoadResult",
    "full_state_dict",
    "layout_of",
    "load_optim_state_dict",
    "load_state_dict",
    "optim_state_dict",
    "state_dict",
]

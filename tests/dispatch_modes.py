"""A dispatch mode for tests that changes nothing: under it (as under selective checkpointing,
``FlopCounterMode`` or a debugging mode) ringflash's entry points take the custom ops instead of
their eager autograd Functions (``kernels.ops.use_ops``)."""

from torch.utils._python_dispatch import TorchDispatchMode


class PassThrough(TorchDispatchMode):
    """Runs each op as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

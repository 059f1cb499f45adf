"""The model inside fairseq's wrappers (shared by the paper packages)."""


def unwrap_model(model):
    """``model`` with fairseq's distributed wrappers (``DistributedDataParallel``,
    ``ModuleProxyWrapper``, ...) taken off: follows ``.module`` to the model itself."""
    while hasattr(model, "module"):
        model = model.module
    return model

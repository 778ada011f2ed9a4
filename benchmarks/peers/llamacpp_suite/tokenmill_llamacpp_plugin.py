"""A pytest plugin for llama.cpp's server tests (loaded by run.py with `-p tokenmill_llamacpp_plugin`): their
session starts every ServerPreset once before the first test only to download its model from the Hub
(ServerPreset.load_all); here the models are local files, so that step is skipped. Each test still starts its own
server as written (through llama_server_shim.py)."""


def _no_download() -> None:
    """The models are local files ($TOKENMILL_SUITE_MODEL)."""


def pytest_configure(config) -> None:
    import utils

    utils.ServerPreset.load_all = staticmethod(_no_download)

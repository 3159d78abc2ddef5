"""The OpenAI API tests' shared fixtures, over a test module's own `built` fixture (its model repository, and the
GPT-2 folder its generators were converted from): transformers on that folder, a server on the repository, and the
official client. A module whose server needs flags defines its own `server`, which takes the place of this one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import ServerProcess, start_transerve
from support.openai_models import GPT2Reference


@pytest.fixture(scope="module")
def reference(built) -> GPT2Reference:
    return GPT2Reference(built[1])


@pytest.fixture(scope="module")
def server(built) -> Iterator[ServerProcess]:
    with start_transerve(built[0]) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as opened:
        yield opened

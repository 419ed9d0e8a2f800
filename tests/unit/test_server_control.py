"""The control client's answers when no server listens (a real server answers it in
tests/integration: test_rollout.py, test_overload.py, test_serve_cli.py)."""

import pytest

from tools.server.control import ControlError, ServerControl, host_port
from tools.server.triton_server import free_port


def test_an_address_is_taken_with_or_without_its_scheme():
    assert host_port("http://localhost:8000/") == "localhost:8000"
    assert host_port("localhost:8000") == "localhost:8000"
    assert ServerControl("https://127.0.0.1:9/").address == "127.0.0.1:9"


def test_a_server_that_does_not_answer_is_an_error_that_says_so_and_not_ready():
    control = ServerControl(f"127.0.0.1:{free_port()}", admin_key="k" * 24, timeout_s=5)
    for call in (control.ready_versions, lambda: control.load("embed", config={"name": "embed"}),
                 lambda: control.model_config("embed"), control.is_server_live):
        with pytest.raises(ControlError, match=r"tritonserver at 127\.0\.0\.1:\d+ is not answering"):
            call()
    assert not control.is_server_ready()
    assert not control.is_model_ready("embed", 1)


def test_the_admin_key_goes_in_the_headers_and_not_in_the_repr():
    control = ServerControl("localhost:8000", admin_key="secret-key-of-24-characters")
    assert control.admin_headers == {"triton-admin-key": "secret-key-of-24-characters"}
    assert "secret" not in repr(control)
    assert ServerControl("localhost:8000").admin_headers == {}

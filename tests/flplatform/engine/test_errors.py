"""Site errors reach the ledger as one readable line."""

from __future__ import annotations

import pytest
from flwr.app import Error, Message, MessageType, RecordDict

from flplatform.core import keys
from flplatform.engine.replies import condense_error
from flplatform.engine.rows import refused_at_site, site_error

pytestmark = pytest.mark.usefixtures("task_identity")

RAY_TRACEBACK = (
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()"
    '\x1b[39m (pid=1, ip=127.0.0.1)\n  File "client_app.py", line 161, in __call__\n'
    "    return self._registered_funcs[full_name](message, context)\n"
    "RuntimeError: disk on fire at this site\n\nThe above exception was the direct cause:\n"
    "flwr.clientapp.client_app.ClientAppException:\n"
)


def test_the_sites_own_exception_is_kept() -> None:
    assert condense_error(RAY_TRACEBACK) == "RuntimeError: disk on fire at this site"


def test_plain_reasons_pass_through_and_are_bounded() -> None:
    assert condense_error("Message Unavailable") == "Message Unavailable"
    assert condense_error("") == "no reason given"
    assert len(condense_error("x" * 1000)) == 300


def test_an_exception_of_any_name_is_found_and_source_lines_are_not() -> None:
    traceback = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run()"
        " (pid=1, ip=127.0.0.1)\n"
        '  File "task.py", line 9, in train\n'
        "    Config.Scale: float = load()\n"
        "mylab.checks.SiteMisconfigured: data-path is not set in the node config\n\n"
        "The above exception was the direct cause of the following exception:\n"
        "flwr.clientapp.client_app.ClientAppException: \n"
        "Exception ClientAppException occurred. Message: data-path is not set'>"
    )
    assert condense_error(traceback) == (
        "mylab.checks.SiteMisconfigured: data-path is not set in the node config"
    )


def test_a_note_after_the_exception_is_not_taken_for_it() -> None:
    assert condense_error("torch.OutOfMemoryError: CUDA out of memory\nNote: see the docs") == (
        "torch.OutOfMemoryError: CUDA out of memory"
    )
    assert condense_error("KeyError: 'w'\nHint: check the model's keys") == "KeyError: 'w'"
    assert condense_error("Refused: no data-path") == "Refused: no data-path"  # only that


def test_only_flplatforms_own_refusals_are_rejections() -> None:
    sent = Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN)
    ours = Message(
        Error(code=keys.SITE_REFUSED_CODE, reason=keys.SITE_REFUSED_PREFIX + "no num-examples"),
        reply_to=sent,
    )
    flowers = Message(Error(code=6, reason="the client-side clipping mod needs..."), reply_to=sent)
    assert refused_at_site(ours) and site_error(ours) == "refused at the site: no num-examples"
    assert not refused_at_site(flowers)
    assert site_error(flowers).startswith("site error 6: ")


def test_a_sites_error_reaches_no_terminal_as_control_sequences() -> None:
    """A hostile site's error reason is shown in the server's log and `history updates`:
    its colours go, and every other control character shows as '?' (a terminal's title
    set by OSC, C1's CSI)."""
    said = "ValueError: x\x1b]0;pwned\x07 \x9b2J\tend \x1b[31mred\x1b[0m 東京\rhidden"
    # (the carriage return ends the line, as splitlines has it: the error is the first)
    assert condense_error(said) == "ValueError: x?]0;pwned? ?2J end red 東京"

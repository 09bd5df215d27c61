"""proxy.errors' walk of an error's chain: one walk for the log's cause, the status page's and
the errors kept on long-lived objects."""

from __future__ import annotations

from proxy.errors import chain, kept


def _raised(error: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise error from cause
    except BaseException as caught:  # noqa: BLE001 - any error: its traceback is what counts
        return caught


def test_the_chain_is_the_error_then_its_causes_and_the_members_of_groups() -> None:
    deepest = OSError("deepest")
    member = ValueError("member")
    group = ExceptionGroup("group", [member])
    group.__cause__ = deepest
    top = RuntimeError("top")
    top.__context__ = group
    assert list(chain(top)) == [top, group, member, deepest]


def test_a_looped_chain_is_walked_once_and_ends() -> None:
    first, second = RuntimeError("first"), ValueError("second")
    first.__cause__, second.__cause__ = second, first
    itself = RuntimeError("itself")
    itself.__cause__ = itself
    assert list(chain(first)) == [first, second]
    assert list(chain(itself)) == [itself]


def test_kept_drops_every_traceback_of_the_chain() -> None:
    inner = _raised(OSError("inner"))
    outer = _raised(RuntimeError("outer"), inner)
    inner.__context__ = outer  # and a loop back, which must not hang it
    assert outer.__traceback__ is not None and inner.__traceback__ is not None
    assert kept(outer) is outer
    assert outer.__traceback__ is None and inner.__traceback__ is None

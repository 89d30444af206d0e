"""Exceptions of the loaderd client. Every one carries a message for people; LoaderdRefused
carries loaderd's own words (the "error" of its reply) unchanged in .loaderd_message."""


class LoaderdError(Exception):
    """Base class of every error raised by barq_loaderd."""


class LoaderdConnectionError(LoaderdError):
    """The control socket cannot be reached or broke (loaderd not running, wrong path,
    permission on the socket file)."""


class LoaderdRefused(LoaderdError):
    """loaderd answered {"ok": false, "error": ...}: a refused attach (bad job spec, path
    outside data_roots, too many jobs, draining, ...) or a refused request. str(e) is
    "loaderd refused <op>: <loaderd's message>"; .op and .loaderd_message hold the parts."""

    def __init__(self, op, message):
        super().__init__(f"loaderd refused {op}: {message}")
        self.op = op
        self.loaderd_message = message


class LoaderdProtocolError(LoaderdError):
    """loaderd (or something posing as it) sent something the protocol does not allow: a bad
    reply line, a ring whose header lies, a batch that fails validation (the message names the
    violation, like bt_batch_validate's)."""


class LoaderdTimeout(LoaderdError):
    """No reply / no batch within the time allowed."""


class LoaderdClosed(LoaderdError):
    """The batch stream ended before its end of data: loaderd stopped or failed the job (see
    `loaderctl status`), or went away and did not come back within $LOADERD_RECONNECT_S."""

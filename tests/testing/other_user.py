"""Acting as another, unprivileged user in a test that runs as root.

`run_as` forks and runs a function in the child after it dropped to the user: only
file-system calls the kernel checks against that user, and no imports (the interpreter
of the tests may lie where the user cannot read it). What a shard server sees of a
client is its requests, never its user, so the tests make the requests themselves."""

from __future__ import annotations

import json
import os
import pwd
import traceback
from collections.abc import Callable
from typing import Any


def nobody() -> pwd.struct_passwd | None:
    """The user nobody, when there is one."""
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


def run_as(user: pwd.struct_passwd, fn: Callable[[], Any]) -> Any:
    """fn() in a child process of `user` (its uid, its gid, no other group); its result
    (anything json can carry), or RuntimeError with the child's traceback."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        code, out = 1, '{"error": "the child failed before fn"}'
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            out = json.dumps({"result": fn()})
            code = 0
        except BaseException:  # everything goes back to the test
            out = json.dumps({"error": traceback.format_exc()})
        finally:
            os.write(write_fd, out.encode())
            os._exit(code)
    os.close(write_fd)
    chunks = []
    with os.fdopen(read_fd, "rb") as f:
        while chunk := f.read(65536):
            chunks.append(chunk)
    os.waitpid(pid, 0)
    answer = json.loads(b"".join(chunks) or b'{"error": "no answer"}')
    if "error" in answer:
        raise RuntimeError(f"as user {user.pw_name}: {answer['error']}")
    return answer["result"]

"""`accelerate launch` for the `sharddemo` commands the tests run warm (support/warm_cli.py):
`python warm_client.py SOCKET ARGS` asks the warm server at SOCKET (support/warm_server.py) to
fork the ranks that `accelerate launch ARGS` would start, their stdout and stderr this
process's own (passed over the socket), and exits with the launch's code as the launcher does
(1 where a rank failed). Where accelerate would not start the ranks with torchrun on this
machine alone (the server says so), it becomes that `accelerate launch ARGS` itself. Its end
(killed with the command's launch: a stall, a signal) ends the ranks. Imports no torch."""

from __future__ import annotations

import json
import os
import socket
import sys


def main() -> None:
    path, words = sys.argv[1], sys.argv[2:]
    # (the test's own timeout ends a hung command first: its launch then ends with it)
    request = {"launch": words, "env": dict(os.environ), "cwd": os.getcwd(), "timeout": 600}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [1, 2])
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(1 << 16)
            if not chunk:
                sys.exit("the warm launcher ended during the launch")
            reply += chunk
    answer = json.loads(reply)
    if answer.get("real"):
        os.execv(sys.executable, [sys.executable, "-m", "accelerate.commands.launch", *words])
    sys.exit(answer["rc"])


if __name__ == "__main__":
    main()

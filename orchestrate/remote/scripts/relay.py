"""Stdlib-only script run on a node's host over SSH (`python3 -c`): the image relay (backends/docker_ssh/relay.py).

    serve FILE          on the relay node: listen on a free TCP port of every address, print "PORT <n>", send FILE
                        to each client that first sends the line "DDP-RELAY <token>"; the token is the first line of
                        stdin (never on a command line, where any account of the node reads it). Ends, FILE removed,
                        when stdin closes: when the orchestrator is done, or its SSH connection is gone.
    fetch ADDR PORT SHA256 SIZE DIR LAND...
                        on another node: fetch the archive from the relay into a new file in DIR (the token: the
                        first line of stdin), check its size and sha256, run the command LAND... with it on stdin
                        (`docker load -q` for image layers, the data's unpack script for --data-from), remove the file.
    keep ADDR PORT SHA256 SIZE FILE
                        as fetch, but the checked archive is kept as FILE (a new name in its folder), not landed:
                        the node serves it to the next nodes of a relay tree (`serve FILE`, which removes it) while
                        the orchestrator lands it.
    pack FILE FOLDER NAME...
                        on a node that holds files already (the resume checkpoint): the files NAME... of FOLDER
                        (relative paths) into a new FILE, an uncompressed tar in that order, to be served; prints
                        "<size> <sha256>" of FILE. Exit 6 (FILE removed) when a file cannot be read or FILE written.
Exit 3: the relay cannot be reached; 4: the bytes fetched are short or have another digest; 5: LAND failed.
The reason is the last line on stderr.
"""

import hashlib
import hmac
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading

MAGIC = b"DDP-RELAY "
BLOCK = 1 << 20
CONNECT_S = 10
IDLE_S = 60


def serve(path):
    token = sys.stdin.buffer.readline().strip()
    listener = socket.socket(socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET)
    if listener.family == socket.AF_INET6:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    listener.bind(("", 0))
    listener.listen(64)
    print(f"PORT {listener.getsockname()[1]}", flush=True)

    def one(conn):
        with conn:
            conn.settimeout(IDLE_S)
            line = conn.makefile("rb").readline(len(MAGIC) + 256).strip()
            if not (line.startswith(MAGIC) and hmac.compare_digest(line[len(MAGIC):], token)):
                return
            with open(path, "rb") as fh:
                while block := fh.read(BLOCK):
                    conn.sendall(block)

    def accept():
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        sys.stdin.buffer.read()  # until the orchestrator closes the channel
    finally:
        os.unlink(path)


def fail(code, why):
    print(why, file=sys.stderr)
    sys.exit(code)


def fetch(addr, port, sha256, size, folder, *land, keep=None):
    token = sys.stdin.buffer.readline().strip()
    try:
        conn = socket.create_connection((addr, int(port)), timeout=CONNECT_S)
    except OSError as err:
        fail(3, f"cannot connect to {addr}:{port}: {err.strerror or err}")
    os.makedirs(folder, exist_ok=True)
    # O_EXCL under an unpredictable name: a file or symlink planted beforehand is never opened
    fd, path = tempfile.mkstemp(dir=folder, prefix=".ddp-relay.")
    digest, got = hashlib.sha256(), 0
    try:
        with conn, os.fdopen(fd, "wb") as out:
            conn.settimeout(IDLE_S)
            conn.sendall(MAGIC + token + b"\n")
            while block := conn.recv(BLOCK):
                digest.update(block)
                out.write(block)
                got += len(block)
    except OSError as err:
        os.unlink(path)
        fail(3, f"the relay {addr}:{port} broke off after {got} bytes: {err.strerror or err}")
    if got != int(size) or digest.hexdigest() != sha256:
        os.unlink(path)
        fail(4, f"got {got} of {size} bytes, sha256 {digest.hexdigest()[:12]}, expected {sha256[:12]}")
    if keep is not None:
        os.replace(path, keep)  # kept only once checked: what the node serves next
        return
    try:
        with open(path, "rb") as archive:
            landed = subprocess.run(list(land), stdin=archive, capture_output=True, text=True)
    finally:
        os.unlink(path)
    if landed.returncode != 0:
        fail(5, (landed.stderr.strip().splitlines() or [f"{land[0]} failed"])[-1])


def keep(addr, port, sha256, size, path):
    fetch(addr, port, sha256, size, os.path.dirname(path), keep=path)


def pack(path, folder, *names):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    digest = hashlib.sha256()
    try:
        with tarfile.open(path, "x", format=tarfile.PAX_FORMAT) as tar:  # O_EXCL: never a file planted beforehand
            for name in names:
                tar.add(os.path.join(folder, name), arcname=name, recursive=False)
        with open(path, "rb") as packed:  # read back: what the fetching nodes will check
            while block := packed.read(BLOCK):
                digest.update(block)
    except OSError as err:
        if not isinstance(err, FileExistsError) and os.path.lexists(path):  # ours, part written
            os.unlink(path)
        fail(6, f"cannot pack {err.filename or path}: {err.strerror or err}")
    print(os.path.getsize(path), digest.hexdigest())


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(*sys.argv[2:])
    elif sys.argv[1] == "keep":
        keep(*sys.argv[2:])
    elif sys.argv[1] == "pack":
        pack(*sys.argv[2:])
    else:
        fetch(*sys.argv[2:])

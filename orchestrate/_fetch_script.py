"""Stdlib-only script run INSIDE a short container on a node: fetch, verify and extract CIFAR-10.

Shipped to the node as the argument of `python -c` (no shell): argv = MD5, DATA_DIR, ARCHIVE, BATCHES, MARKER;
the URL ("-": the archive was sent) in the environment variable DATA_URL, never on the command line, where any
account of the node could read a password in it (ps); messages show it with its credentials masked.
Prints PROGRESS <bytes> <total>, then HAVE (already verified) or DONE <downloaded bytes>.
Exit 3: md5 mismatch; exit 4: download failed; exit 5: extraction failed.
"""

import base64
import hashlib
import os
import re
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

# The archive's and the folder's names come from trainer.contract (CIFAR-10's one file table) through argv,
# so this script imports nothing of the project; the marker name is prefetch.py's.
ARCHIVE, BATCHES, MARKER = sys.argv[3:6]


def shown(url):
    return re.sub(r"//[^/@]*@", "//****@", url)


def open_url(url):
    """urlopen takes no user:password@ in a URL: those become a Basic authorization header."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return urllib.request.urlopen(url, timeout=60)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    bare = parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")).geturl()
    user = urllib.parse.unquote(parts.username) + ":" + urllib.parse.unquote(parts.password or "")
    auth = "Basic " + base64.b64encode(user.encode()).decode()
    return urllib.request.urlopen(urllib.request.Request(bare, headers={"Authorization": auth}), timeout=60)


def md5_of(path):
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(url, dest):
    # An unpredictable temporary name created with O_EXCL: a file or symlink planted beforehand is never opened.
    fd, part = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".ddp-cifar.")
    try:
        with open_url(url) as resp, os.fdopen(fd, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0)
            done, last = 0, -1
            while True:
                block = resp.read(1 << 20)
                if not block:
                    break
                out.write(block)
                done += len(block)
                step = done * 20 // total if total else done >> 24
                if step != last:
                    print(f"PROGRESS {done} {total}", flush=True)
                    last = step
    except BaseException:
        os.unlink(part)
        raise
    os.replace(part, dest)
    return done


def main(url, md5, data_dir):
    marker = os.path.join(data_dir, MARKER)
    batches = os.path.join(data_dir, BATCHES)
    if os.path.isdir(batches) and os.path.exists(marker) and open(marker).read().strip() == md5:
        print("HAVE", flush=True)
        return 0
    archive = os.path.join(data_dir, ARCHIVE)
    fetched = 0
    if not (os.path.exists(archive) and md5_of(archive) == md5):
        if url == "-":
            print(f"error: {archive} missing or its md5 differs from {md5}", flush=True)
            return 3
        try:
            fetched = download(url, archive)
        except Exception as err:
            print(f"error: download of {shown(url)} failed: {shown(str(err))}", flush=True)
            return 4
        got = md5_of(archive)
        if got != md5:
            os.replace(archive, archive + ".bad")
            print(f"error: md5 of {shown(url)} is {got}, expected {md5}; check --data-url/--data-md5", flush=True)
            return 3
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(data_dir, filter="data")
            else:
                tar.extractall(data_dir)
    except Exception as err:
        print(f"error: extracting {archive} failed: {err}", flush=True)
        return 5
    if not os.path.isdir(batches):
        print(f"error: {archive} holds no {BATCHES}/ folder", flush=True)
        return 5
    fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=".ddp-cifar.")
    with os.fdopen(fd, "w") as fh:
        fh.write(md5 + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, marker)
    print(f"DONE {fetched}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(os.environ.get("DATA_URL", "-"), sys.argv[1], sys.argv[2]))

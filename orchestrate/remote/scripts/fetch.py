"""Stdlib-only script run INSIDE a short container on a node: fetch, verify and extract CIFAR-10.

Shipped to the node as the argument of `python -c` (no shell): argv = MD5, DATA_DIR, ARCHIVE, BATCHES, MARKER;
the URL ("-": the archive was sent) in the environment variable DATA_URL, never on the command line, where any
account of the node could read a password in it (ps); messages show it with its credentials masked.
Prints PROGRESS <bytes> <total>, then HAVE (already verified) or DONE <downloaded bytes>.
Exit 3: md5 mismatch; exit 4: download failed; exit 5: extraction failed; exit 6: the data folder is too full
(a partial download or extraction is removed; nothing is marked verified).
"""

import base64
import errno
import hashlib
import os
import re
import shutil
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


class NoSpace(Exception):
    """The data folder cannot hold `need` bytes more (it had `free`)."""

    def __init__(self, what, need, free):
        super().__init__(f"no space left for {what}: it needs {need / 1e6:.1f} MB, the folder had "
                         f"{free / 1e6:.1f} MB free; free some space there or choose another data dir")


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def download(url, dest):
    # An unpredictable temporary name created with O_EXCL: a file or symlink planted beforehand is never opened.
    fd, part = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".ddp-cifar.")
    free, total, done = free_bytes(os.path.dirname(dest)), 0, 0
    try:
        with open_url(url) as resp, os.fdopen(fd, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0)
            if total > free:
                raise NoSpace("the download", total, free)
            last = -1
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
    except BaseException as err:
        os.unlink(part)
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            raise NoSpace("the download", max(total, done), free) from None
        raise
    os.replace(part, dest)
    return done


class Hostile(Exception):
    """A member the data filter would refuse: it would write outside the data folder, or is a device."""


def _inside(path, data_dir):
    """Whether `path` (symlinks already on disk followed) is within data_dir."""
    root = os.path.realpath(data_dir)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def safe_member(member, data_dir):
    """What tarfile's data filter checks (PEP 706), for a Python without it: no absolute name or one that leaves
    the folder (`..`, through a symlink extracted before), no link pointing out of it, no device or pipe; and no
    setuid, setgid, sticky or group/other write bit. Checked as each member is extracted, so that a link an
    earlier member made is followed."""
    name = member.name
    if name.startswith("/") or os.path.isabs(name) or not _inside(os.path.join(data_dir, name), data_dir):
        raise Hostile(f"member {name!r} would be written outside {data_dir}")
    if member.ischr() or member.isblk() or member.isfifo():
        raise Hostile(f"member {name!r} is a device or a pipe")
    if member.issym() or member.islnk():
        link = member.linkname
        # a symlink's target is relative to its own folder; a hard link's to the archive's root
        base = os.path.dirname(os.path.join(data_dir, name)) if member.issym() else data_dir
        if os.path.isabs(link) or not _inside(os.path.join(base, link), data_dir):
            raise Hostile(f"member {name!r} links to {link!r}, outside {data_dir}")
    member.mode &= 0o755  # high bits and group/other write cleared, as the data filter does
    return member


def extract(archive, data_dir):
    """Extract after checking the files fit (with what the folder holds now); a disk filled meanwhile is NoSpace."""
    with tarfile.open(archive) as tar:
        need, free = sum(m.size for m in tar.getmembers() if m.isfile()), free_bytes(data_dir)
        if need > free:
            raise NoSpace("extracting the archive", need, free)
        try:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(data_dir, filter="data")
            else:  # a Python before the filter (3.11.4, 3.10.12...): its checks, member by member, done here
                for member in tar:
                    tar.extract(safe_member(member, data_dir), data_dir)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise NoSpace("extracting the archive", need, free) from None
            raise


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
        except NoSpace as err:
            print(f"error: {err}", flush=True)
            return 6
        except Exception as err:
            print(f"error: download of {shown(url)} failed: {shown(str(err))}", flush=True)
            return 4
        got = md5_of(archive)
        if got != md5:
            os.replace(archive, archive + ".bad")
            print(f"error: md5 of {shown(url)} is {got}, expected {md5}; check --data-url/--data-md5", flush=True)
            return 3
    try:
        extract(archive, data_dir)
    except NoSpace as err:
        shutil.rmtree(batches, ignore_errors=True)  # what was extracted is partial: never left to look complete
        print(f"error: {err}", flush=True)
        return 6
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

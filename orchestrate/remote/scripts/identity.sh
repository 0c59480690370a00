# shellcheck shell=sh
# Run on a host over SSH (orchestrate/remote/ssh.py): who the login is. Four lines: uid, gid, name, home.
id -u && id -g && id -un && printf '%s\n' "$HOME"

# shellcheck shell=sh
# Run as the entrypoint of a short container of the job's image (orchestrate/probe/imagecheck.py): find a Python
# (python or python3) and run check_image.py with it. $1: check_image.py's source, $2/$3: the entry kind and target,
# only ever passed as arguments, never pasted into code.
py=$(command -v python || command -v python3) || { echo '{"python": null}'; exit 0; }
exec "$py" -c "$1" "$2" "$3"

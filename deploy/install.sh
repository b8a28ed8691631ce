#!/bin/sh
# Install aoed as a systemd service from this source tree, or remove it.
#
#   deploy/install.sh [--prefix DIR] [--destdir DIR] [--no-venv] [--python PY]
#   deploy/install.sh --uninstall [--purge] [--prefix DIR] [--destdir DIR]
#
# Installs:
#   PREFIX/venv/                        a virtual environment with aoed (pip, from this tree)
#   PREFIX/share/aoed/                  the default aoed.toml and the drop-in examples
#   PREFIX/share/doc/aoed/README.md     the operator's guide
#   PREFIX/share/doc/aoed/grafana-dashboard.json   an example dashboard of its metrics
#   /usr/lib/systemd/system/aoed.service
#   /usr/lib/sysusers.d/aoed.conf       the user and group aoed
#   /usr/lib/tmpfiles.d/aoed.conf       /var/lib/aoed and its inbox/, outbox/, failed/
#   /etc/aoed/aoed.toml                 only when there is none: yours is never replaced
# then, when systemd runs this machine and no --destdir is given: systemd-sysusers,
# systemd-tmpfiles --create, systemctl daemon-reload, systemctl enable --now aoed (and a
# restart when the service was already running, so that it runs the new code).
#
# Running it again changes nothing but the program (that is how to upgrade): the bank,
# the job store and the drop folders under /var/lib/aoed, and /etc/aoed, stay.
#
# Options:
#   --prefix DIR   where the program goes (default /opt/aoed); the unit is rewritten to match
#   --destdir DIR  stage every file under DIR instead of / (packagers); systemd is left alone.
#                  A venv made there records DIR in its scripts: packagers usually pass
#                  --no-venv and make the venv at PREFIX when the package is installed.
#   --no-venv      skip making the virtual environment (only that: every other file is laid out)
#   --python PY    the interpreter the venv is made from (default python3; 3.11 or newer)
#   --uninstall    stop and disable the service, remove the program and the files above,
#                  but keep /var/lib/aoed (bank, jobs, drop folders) and /etc/aoed
#   --purge        with --uninstall (or alone): also remove /var/lib/aoed, /etc/aoed and
#                  the drop-ins in /etc/systemd/system/aoed.service.d. The user and group
#                  aoed stay (files elsewhere may still belong to them): userdel aoed.
set -eu

usage() {
    sed -n '2,/^set -eu$/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit "${1:-0}"
}

die() {
    echo "install.sh: error: $*" >&2
    exit 1
}

say() {
    echo "install.sh: $*"
}

PREFIX=/opt/aoed
DESTDIR=
VENV=yes
PYTHON=python3
ACTION=install
PURGE=no

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
        --prefix=*) PREFIX=${1#*=}; shift ;;
        --destdir) [ $# -ge 2 ] || die "--destdir needs a directory"; DESTDIR=$2; shift 2 ;;
        --destdir=*) DESTDIR=${1#*=}; shift ;;
        --python) [ $# -ge 2 ] || die "--python needs an interpreter"; PYTHON=$2; shift 2 ;;
        --python=*) PYTHON=${1#*=}; shift ;;
        --no-venv) VENV=no; shift ;;
        --uninstall) ACTION=uninstall; shift ;;
        --purge) ACTION=uninstall; PURGE=yes; shift ;;
        -h|--help) usage 0 ;;
        *) echo "install.sh: error: unknown option $1" >&2; usage 2 >&2 ;;
    esac
done

# The prefix is written into the unit with sed: keep it to plain absolute paths.
case "$PREFIX" in
    /*) ;;
    *) die "--prefix $PREFIX: expected an absolute path" ;;
esac
case "$PREFIX" in
    *[!A-Za-z0-9/._+-]*) die "--prefix $PREFIX: use letters, digits and / . _ + - only" ;;
esac
PREFIX=${PREFIX%/}
[ -n "$PREFIX" ] || die "--prefix /: choose a directory of its own, such as /opt/aoed"
if [ -n "$DESTDIR" ]; then
    mkdir -p "$DESTDIR"
    DESTDIR=$(cd "$DESTDIR" && pwd)
    [ "$DESTDIR" != / ] || DESTDIR=
elif [ "$(id -u)" -ne 0 ]; then
    die "installing into / needs root (or stage the files with --destdir DIR)"
fi

# The source tree is the one this script belongs to, wherever it is run from.
DEPLOY=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$DEPLOY")

UNIT=/usr/lib/systemd/system/aoed.service
SYSUSERS=/usr/lib/sysusers.d/aoed.conf
TMPFILES=/usr/lib/tmpfiles.d/aoed.conf
CONFIG=/etc/aoed/aoed.toml
STATE=/var/lib/aoed
DROPINS=/etc/systemd/system/aoed.service.d

# systemd is asked to act only on the running system, never on a staging tree.
if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
    SYSTEMD=yes
else
    SYSTEMD=no
fi

# What was written, one path a line: a staged install (--destdir) lists it at the end.
WRITTEN=

# put MODE SRC DST: install one file (its folder made as needed); same result every run.
put() {
    mkdir -p "$(dirname "$DESTDIR$3")"
    cp "$2" "$DESTDIR$3.tmp"
    chmod "$1" "$DESTDIR$3.tmp"
    mv -f "$DESTDIR$3.tmp" "$DESTDIR$3"
    WRITTEN="$WRITTEN$DESTDIR$3
"
}

# folder MODE DIR: make a folder with exactly this mode (setgid included).
folder() {
    mkdir -p "$DESTDIR$2"
    chmod "$1" "$DESTDIR$2"
}

install_files() {
    if [ "$VENV" = yes ]; then
        command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON here (choose an interpreter with --python)"
        "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
            || die "$PYTHON is older than 3.11 (choose another with --python)"
        if [ ! -x "$DESTDIR$PREFIX/venv/bin/python" ]; then
            say "making the virtual environment $DESTDIR$PREFIX/venv"
            mkdir -p "$DESTDIR$PREFIX"
            "$PYTHON" -m venv "$DESTDIR$PREFIX/venv"
        fi
        # pip builds a source tree in place (build/, *.egg-info); building a copy keeps
        # root-owned files out of the checkout.
        say "installing aoed from $SRC into $DESTDIR$PREFIX/venv"
        mkdir "$work/src"
        cp -R "$SRC/pyproject.toml" "$SRC/README.md" "$SRC/client" "$SRC/daemon" "$work/src/"
        "$DESTDIR$PREFIX/venv/bin/python" -m pip install --quiet --upgrade pip
        # Both distributions in one call: the daemon's requires the client's (aoed-client).
        "$DESTDIR$PREFIX/venv/bin/python" -m pip install --quiet --upgrade "$work/src/client" "$work/src"
    fi

    sed "s|/opt/aoed|$PREFIX|g" "$DEPLOY/systemd/aoed.service" >"$work/aoed.service"
    put 0644 "$work/aoed.service" "$UNIT"
    put 0644 "$DEPLOY/sysusers.d/aoed.conf" "$SYSUSERS"
    put 0644 "$DEPLOY/tmpfiles.d/aoed.conf" "$TMPFILES"
    put 0644 "$DEPLOY/aoed.toml" "$PREFIX/share/aoed/aoed.toml"
    for example in "$DEPLOY"/systemd/aoed.service.d/*.conf.example; do
        put 0644 "$example" "$PREFIX/share/aoed/$(basename "$example")"
    done
    put 0644 "$DEPLOY/README.md" "$PREFIX/share/doc/aoed/README.md"
    put 0644 "$DEPLOY/grafana-dashboard.json" "$PREFIX/share/doc/aoed/grafana-dashboard.json"
    if [ -e "$DESTDIR$CONFIG" ]; then
        say "keeping $DESTDIR$CONFIG (the shipped one is $PREFIX/share/aoed/aoed.toml)"
    else
        put 0644 "$DEPLOY/aoed.toml" "$CONFIG"
    fi
    # The state folders as tmpfiles.d/aoed.conf describes them; on a running system
    # systemd-tmpfiles then gives them to the user aoed.
    folder 0750 "$STATE"
    for d in inbox outbox failed; do
        folder 2770 "$STATE/$d"
    done

    if [ "$SYSTEMD" = yes ]; then
        was_active=no
        if systemctl --quiet is-active aoed 2>/dev/null; then
            was_active=yes
        fi
        systemd-sysusers "$SYSUSERS"
        systemd-tmpfiles --create "$TMPFILES"
        systemctl daemon-reload
        systemctl enable --now aoed
        if [ "$was_active" = yes ] && [ "$VENV" = yes ]; then
            say "restarting aoed to run the new version (running jobs go back to the queue)"
            systemctl restart aoed
        fi
        say "aoed is running: systemctl status aoed; journalctl -u aoed"
    elif [ -z "$DESTDIR" ]; then
        say "systemd is not running here: create the user and folders, then start aoed yourself:"
        say "  systemd-sysusers $SYSUSERS; systemd-tmpfiles --create $TMPFILES"
        say "  $PREFIX/venv/bin/aoed --config $CONFIG"
    else
        say "staged under $DESTDIR (systemd left alone):"
        if [ "$VENV" = yes ]; then
            say "  $DESTDIR$PREFIX/venv/ (the virtual environment)"
        fi
        printf '%s' "$WRITTEN" | while IFS= read -r path; do
            say "  $path"
        done
        say "  $DESTDIR$STATE/ with inbox/, outbox/ and failed/ (empty)"
        say "check the unit (it names $PREFIX/venv/bin/aoed, which exists only once installed at $PREFIX;"
        say "that missing command is the one complaint to expect):"
        say "  systemd-analyze verify $DESTDIR$UNIT"
        say "  systemd-analyze security --offline=true $DESTDIR$UNIT"
    fi
}

uninstall_files() {
    if [ "$SYSTEMD" = yes ]; then
        # Not loaded (never installed, or removed by hand) is not an error here.
        systemctl disable --now aoed 2>/dev/null || true
    fi
    rm -f "$DESTDIR$UNIT" "$DESTDIR$SYSUSERS" "$DESTDIR$TMPFILES"
    rm -rf "$DESTDIR$PREFIX/venv" "$DESTDIR$PREFIX/share/aoed" "$DESTDIR$PREFIX/share/doc/aoed"
    # PREFIX itself goes only when nothing else lives there.
    for d in "$PREFIX/share/doc" "$PREFIX/share" "$PREFIX"; do
        rmdir "$DESTDIR$d" 2>/dev/null || true
    done
    if [ "$PURGE" = yes ]; then
        rm -rf "$DESTDIR$STATE" "$DESTDIR/etc/aoed" "$DESTDIR$DROPINS"
        say "removed aoed, its state ($STATE) and its configuration (/etc/aoed)"
    else
        say "removed aoed; kept $STATE (bank, jobs, drop folders) and /etc/aoed (--purge removes them)"
    fi
    if [ "$SYSTEMD" = yes ]; then
        systemctl daemon-reload
    fi
}

if [ "$ACTION" = install ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    install_files
else
    uninstall_files
fi

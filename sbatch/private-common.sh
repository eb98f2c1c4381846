# Sourced by sbatch/private-cluster.sh and sbatch/private-multinode.sh (not run on its own): what both private
# clusters need on this machine, as root.
#
#   install_packages [COMMAND ...]   # the Debian packages of slurmctld slurmd sbatch munged and of the extra commands
#                                    # named, installed with apt-get when one of the commands is missing
#   start_munge                      # munged with a key, unless one already answers on its socket

# the package that brings each command
declare -A PRIVATE_PACKAGE=([slurmctld]=slurmctld [slurmd]=slurmd [sbatch]=slurm-client [munged]=munge
                            [ip]=iproute2 [unshare]=util-linux [nsenter]=util-linux)

install_packages() {
  local c missing=()
  for c in slurmctld slurmd sbatch munged "$@"; do
    command -v "$c" >/dev/null || missing+=("${PRIVATE_PACKAGE[$c]:?no package known for the command $c}")
  done
  [ "${#missing[@]}" -eq 0 ] && return  # a package named twice (util-linux) is fine for apt-get
  command -v apt-get >/dev/null || {
    echo "$0: missing ${missing[*]} and there is no apt-get here: install them with your package manager" >&2
    exit 1
  }
  echo "$0: installing ${missing[*]} (Debian packages)" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

MUNGE_SOCKET=/run/munge/munge.socket.2

start_munge() {
  if pgrep -x munged >/dev/null; then
    [ -S "$MUNGE_SOCKET" ] && return
    # a munged without its socket (its package removed and installed again under it) answers no one: replace it
    echo "$0: munged runs without $MUNGE_SOCKET: restarting it" >&2
    pkill -x munged || true
    for _ in $(seq 1 20); do pgrep -x munged >/dev/null || break; sleep 0.5; done
  fi
  mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
  chmod 0400 /etc/munge/munge.key
  su -s /bin/sh munge -c /usr/sbin/munged
}

#!/usr/bin/env bash
# A single-node Ceph cluster with an in-memory OSD and a RADOS Gateway serving S3 on loopback, for tests and
# for trying the S3 path on one machine. Usage: start.sh DIR [PORT]; prints the S3 endpoint when ready.
# Stop with: stop.sh DIR. Needs Debian's radosgw, ceph-mon and ceph-osd (make installs them).
set -euo pipefail
dir=$(realpath -m "${1:?usage: start.sh DIR [PORT]}")
port=${2:-7480}
access_key=${AWS_ACCESS_KEY_ID:-eagle3test}
secret_key=${AWS_SECRET_ACCESS_KEY:-eagle3testsecret}
mkdir -p "$dir"/{mon,osd,rgw,run,log}
fsid=$(uuidgen)
conf="$dir/ceph.conf"
cat > "$conf" <<CONF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:3300
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon allow pool delete = true
osd pool default pg num = 8
osd objectstore = memstore
memstore device bytes = 2147483648
osd crush chooseleaf type = 0
run dir = $dir/run
log file = $dir/log/\$name.log
mon data = $dir/mon/\$cluster-\$id
osd data = $dir/osd/\$cluster-\$id
[client.rgw.a]
rgw data = $dir/rgw
# Nagle's algorithm off: with it a batch delete, a listing or a multipart upload's start took ~40 ms here against
# ~4 ms (the gateway's second small write waited for the client's delayed ACK)
rgw frontends = beast endpoint=127.0.0.1:$port tcp_nodelay=1
# a deleted object's data is freed within seconds, not after RGW's default 2 hours: repeated writes (a benchmark,
# a long test session) would otherwise fill the in-memory OSD, and a full OSD blocks every write without an error
rgw gc obj min wait = 0
rgw gc processor period = 2
ms mon client mode = crc
CONF
ceph_cmd() { "$@" -c "$conf"; }
monmaptool --create --addv a '[v2:127.0.0.1:3300]' --fsid "$fsid" "$dir/monmap" >/dev/null
ceph-authtool --create-keyring "$dir/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph_cmd ceph-mon --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/mon.keyring"
ceph_cmd ceph-mon -i a
osd_uuid=$(uuidgen)
osd_id=$(ceph_cmd ceph osd new "$osd_uuid")
mkdir -p "$dir/osd/ceph-$osd_id"
ceph_cmd ceph-osd -i "$osd_id" --mkfs --osd-uuid "$osd_uuid" >/dev/null 2>&1
ceph_cmd ceph-osd -i "$osd_id"
ceph_cmd radosgw -n client.rgw.a
for _ in $(seq 1 120); do
  if curl -s -o /dev/null "http://127.0.0.1:$port"; then break; fi
  sleep 0.5
done
ceph_cmd radosgw-admin -n client.rgw.a user create --uid=eagle3 --display-name=eagle3 \
  --access-key="$access_key" --secret="$secret_key" >/dev/null
echo "http://127.0.0.1:$port"

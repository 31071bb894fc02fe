# Throwaway certificates for mutual TLS on this machine: a CA and, per name,
# a key and a certificate for both server and client use whose identity is
# the URI SAN spiffe://outbox/NAME (with DNS SANs localhost and
# outbox-NAME, IP SAN 127.0.0.1, CN NAME). Source it; it defines functions
# only. Needs openssl.

# make_ca DIR: DIR/ca.crt and DIR/ca.key (EC P-256, valid 30 days), unless
# they exist.
make_ca() {
  local dir="$1"
  mkdir -p "$dir"
  chmod 700 "$dir"
  [ -f "$dir/ca.crt" ] && return 0
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" -days 30 \
    -subj "/CN=outbox throwaway CA $(date +%s)" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null ||
    { echo "openssl: cannot make a CA in $dir" >&2; return 1; }
  chmod 600 "$dir/ca.key"
}

# make_cert DIR NAME [URI]: DIR/NAME.crt and DIR/NAME.key signed by DIR's
# CA; the identity is URI (default spiffe://outbox/NAME). Overwrites: call
# it again to rotate.
make_cert() {
  local uri="${3:-spiffe://outbox/$2}"
  make_cert_san "$1" "$2" "URI:$uri,DNS:localhost,DNS:outbox-$2,IP:127.0.0.1"
}

# make_cert_san DIR NAME SAN: as make_cert, with CN NAME and the
# subjectAltName SAN as given (e.g. "DNS:reader.example", or "" for a
# certificate named by its CN alone).
make_cert_san() {
  local dir="$1" name="$2" san="$3" ext
  ext=$(mktemp)
  {
    [ -z "$san" ] || echo "subjectAltName=$san"
    cat <<EXT
extendedKeyUsage=serverAuth,clientAuth
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
EXT
  } >"$ext"
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "$dir/$name.key.new" -out "$dir/$name.csr" -subj "/CN=$name" 2>/dev/null &&
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
      -CAcreateserial -out "$dir/$name.crt.new" -days 30 -extfile "$ext" 2>/dev/null ||
    { rm -f "$ext"; echo "openssl: cannot make a certificate for $name" >&2; return 1; }
  rm -f "$ext" "$dir/$name.csr"
  chmod 600 "$dir/$name.key.new"
  # Replaced by rename, so a process re-reading them never sees half a file.
  mv "$dir/$name.key.new" "$dir/$name.key"
  mv "$dir/$name.crt.new" "$dir/$name.crt"
}

# make_certs DIR [NAMES...]: a CA and a certificate per name (default: the
# three services and outboxctl).
make_certs() {
  local dir="$1" name
  shift
  make_ca "$dir" || return 1
  for name in "${@:-producer relay consumer outboxctl}"; do
    for n in $name; do make_cert "$dir" "$n" || return 1; done
  done
}

#!/usr/bin/env bash
# Generates throw-away TLS material for the security tests into DIR (never
# committed): a CA, a server certificate for localhost/127.0.0.1/::1 signed by
# it, a client certificate signed by it, and a second, unrelated CA with a
# client certificate of its own (the "wrong client" of the mTLS tests).
#   make_test_certs.sh DIR
# Files: ca.pem ca.key server.pem server.key client.pem client.key
#        other-ca.pem other-ca.key other-client.pem other-client.key
set -euo pipefail
dir=${1:?usage: make_test_certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
days=2
subj() { echo "/O=qstream tests/CN=$1"; }

ca() {  # name
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
    -keyout "$1.key" -out "$1.pem" -subj "$(subj "$1")" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

leaf() {  # name ca usage san
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "$(subj "$1")" 2>/dev/null
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=%s\n%s\n' "$3" "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days "$days" \
    -out "$1.pem" -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca
ca other-ca
leaf server ca serverAuth "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1"
leaf client ca clientAuth "subjectAltName=DNS:qstream-actor"
leaf other-client other-ca clientAuth "subjectAltName=DNS:qstream-actor"
rm -f ./*.srl
chmod 600 ./*.key

#include "tests/harness/throwaway_tls.h"

#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <memory>

namespace kvstash::harness {
namespace {

struct Free {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
  void operator()(X509* x) const { X509_free(x); }
  void operator()(X509_EXTENSION* e) const { X509_EXTENSION_free(e); }
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using Key = std::unique_ptr<EVP_PKEY, Free>;
using Cert = std::unique_ptr<X509, Free>;

Status openssl_failed(const char* what) {
  char buf[256] = "no reason given";
  if (unsigned long e = ERR_get_error()) ERR_error_string_n(e, buf, sizeof buf);
  ERR_clear_error();
  return Status::internal(std::string(what) + ": " + buf);
}

bool add_ext(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  std::unique_ptr<X509_EXTENSION, Free> ext(X509V3_EXT_conf_nid(nullptr, &ctx, nid, value));
  return ext && X509_add_ext(cert, ext.get(), -1) == 1;
}

// A certificate for `key` named `cn`, signed by `issuer_key` as `issuer` (itself when null),
// with the extensions given as (nid, value) pairs.
Result<Cert> make_cert(EVP_PKEY* key, const char* cn, X509* issuer, EVP_PKEY* issuer_key,
                       std::initializer_list<std::pair<int, const char*>> exts) {
  Cert cert(X509_new());
  if (!cert) return openssl_failed("X509_new");
  unsigned char serial[16];
  RAND_bytes(serial, sizeof serial);
  serial[0] &= 0x7f;
  BIGNUM* bn = BN_bin2bn(serial, sizeof serial, nullptr);
  ASN1_INTEGER* sn = BN_to_ASN1_INTEGER(bn, nullptr);
  BN_free(bn);
  X509_set_serialNumber(cert.get(), sn);
  ASN1_INTEGER_free(sn);
  X509_set_version(cert.get(), 2);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), 24 * 3600);
  X509_set_pubkey(cert.get(), key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(cn), -1, -1, 0);
  X509* signer = issuer != nullptr ? issuer : cert.get();
  X509_set_issuer_name(cert.get(), X509_get_subject_name(signer));
  for (const auto& [nid, value] : exts) {
    if (!add_ext(cert.get(), signer, nid, value)) return openssl_failed("X509V3_EXT_conf_nid");
  }
  if (X509_sign(cert.get(), issuer_key != nullptr ? issuer_key : key, EVP_sha256()) == 0) {
    return openssl_failed("X509_sign");
  }
  return cert;
}

Status write_pem(const std::string& path, X509* cert, EVP_PKEY* key) {
  std::unique_ptr<std::FILE, Free> f(std::fopen(path.c_str(), "w"));
  if (!f) return Status::from_errno("open " + path, errno);
  // A key private to its owner, as kvstashd --tls-key requires.
  if (key != nullptr && ::fchmod(::fileno(f.get()), 0600) != 0)
    return Status::from_errno("chmod " + path, errno);
  const int ok = cert != nullptr ? PEM_write_X509(f.get(), cert)
                                 : PEM_write_PrivateKey(f.get(), key, nullptr, nullptr, 0, nullptr, nullptr);
  if (ok != 1) return openssl_failed("PEM_write");
  return {};
}

}  // namespace

Result<ThrowawayTls> make_throwaway_tls(const std::string& dir, const std::string& ca_name) {
  Key ca_key(EVP_EC_gen("P-256")), server_key(EVP_EC_gen("P-256")), client_key(EVP_EC_gen("P-256"));
  if (!ca_key || !server_key || !client_key) return openssl_failed("EVP_EC_gen");
  KVSTASH_ASSIGN_OR_RETURN(Cert ca, make_cert(ca_key.get(), ca_name.c_str(), nullptr, nullptr,
                                              {{NID_basic_constraints, "critical,CA:TRUE"},
                                               {NID_key_usage, "critical,keyCertSign,cRLSign"},
                                               {NID_subject_key_identifier, "hash"}}));
  KVSTASH_ASSIGN_OR_RETURN(Cert server,
                           make_cert(server_key.get(), "kvstash node", ca.get(), ca_key.get(),
                                     {{NID_basic_constraints, "critical,CA:FALSE"},
                                      {NID_key_usage, "critical,digitalSignature"},
                                      {NID_ext_key_usage, "serverAuth,clientAuth"},
                                      {NID_subject_alt_name, "IP:127.0.0.1,IP:::1,DNS:localhost"},
                                      {NID_authority_key_identifier, "keyid"}}));
  KVSTASH_ASSIGN_OR_RETURN(Cert client, make_cert(client_key.get(), "kvstash client", ca.get(), ca_key.get(),
                                                  {{NID_basic_constraints, "critical,CA:FALSE"},
                                                   {NID_key_usage, "critical,digitalSignature"},
                                                   {NID_ext_key_usage, "clientAuth"},
                                                   {NID_authority_key_identifier, "keyid"}}));
  ThrowawayTls t{dir + "/ca.pem", dir + "/node.pem", dir + "/node.key", dir + "/client.pem",
                 dir + "/client.key"};
  KVSTASH_RETURN_IF_ERROR(write_pem(t.ca_cert, ca.get(), nullptr));
  KVSTASH_RETURN_IF_ERROR(write_pem(t.server_cert, server.get(), nullptr));
  KVSTASH_RETURN_IF_ERROR(write_pem(t.server_key, nullptr, server_key.get()));
  KVSTASH_RETURN_IF_ERROR(write_pem(t.client_cert, client.get(), nullptr));
  KVSTASH_RETURN_IF_ERROR(write_pem(t.client_key, nullptr, client_key.get()));
  return t;
}

}  // namespace kvstash::harness

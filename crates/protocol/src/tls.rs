//! TLS on the controller's gRPC channel (agents' sessions, `lazarus status`), by `rustls`:
//! tonic's on the clients' side, the controller's own handshake (with a deadline) on its side. Two ways to trust the controller:
//!
//! * **From the job's secret** (the default). The controller's key is an Ed25519 key derived
//!   from the secret (HMAC-SHA-256 of it, a context apart from every other use); at start the
//!   controller makes a self-signed certificate for it. Whoever holds the secret file derives
//!   the same public key and *pins* it: the client accepts the handshake only if it is signed
//!   by that key, whatever the certificate says. Nothing to distribute beyond the secret file
//!   the agents need anyway, and a controller of another job (or a man in the middle) fails the
//!   handshake. Whoever holds the secret could act as the controller — as they could already
//!   answer its challenge — so the secret file stays the job's one credential.
//! * **The operator's certificates** (`--tls-cert/--tls-key`, and `--tls-ca`): the controller
//!   serves the given certificate, clients check it against the CA (its names: the host of
//!   `--controller`), and with a CA on the controller's side, clients must present a
//!   certificate it signed (mutual TLS).
//!
//! The secret itself never crosses the network either way: agents and workers prove it by
//! challenge-response (`lazarus_comm::auth`), inside the encrypted channel.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use lazarus_comm::pinned::PinnedKey;
use rustls::pki_types::CertificateDer;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::error::ControlError;
use lazarus_setting::Setting;

/// An Ed25519 public key the controller's handshake must be signed with.
pub use lazarus_comm::pinned::Pin;

/// The name in the certificate a controller makes for itself (clients pinning its key do not
/// check names: the key is the identity).
const SELF_SIGNED_NAME: &str = "lazarus-controller";

/// PEM files an operator gives: the controller's (or a client's) certificate and key, and the
/// CA that signs the other side's.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    pub cert_pem: Option<Vec<u8>>,
    pub key_pem: Option<Vec<u8>>,
    pub ca_pem: Option<Vec<u8>>,
}

/// How a controller serves TLS.
#[derive(Debug, Clone)]
pub enum ServerTls {
    /// A certificate made at start for the key the job's secret gives.
    FromSecret(u128),
    /// The operator's certificate and key; with a CA, clients must present a certificate it
    /// signed.
    Given { cert_pem: Vec<u8>, key_pem: Vec<u8>, client_ca_pem: Option<Vec<u8>> },
}

/// How a client (an agent, `lazarus status`) trusts the controller.
#[derive(Debug, Clone)]
pub enum ClientTls {
    /// The handshake must be signed by this key (the job's secret gives it).
    Pinned(Pin),
    /// The controller's certificate must chain to this CA; with an identity (certificate, key),
    /// this client presents it.
    Ca { ca_pem: Vec<u8>, identity: Option<(Vec<u8>, Vec<u8>)> },
}

/// The context of the controller's key: one apart from the ranks'.
const KEY_CONTEXT: &[u8] = b"lazarus controller tls key";

/// The public key a controller of a job of `secret` signs its handshakes with.
pub fn pin(secret: u128) -> Pin {
    lazarus_comm::pinned::pin(secret, KEY_CONTEXT)
}

/// A pin as 64 hex digits (in the status token a controller prints).
pub fn pin_hex(pin: &Pin) -> String {
    pin.iter().map(|b| format!("{b:02x}")).collect()
}

/// A pin from 64 hex digits.
pub fn parse_pin(hex: &str) -> Option<Pin> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut pin = [0u8; 32];
    for (i, b) in pin.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(pin)
}

impl ServerTls {
    /// What accepts the controller's TLS connections: the self-signed certificate made now, or
    /// the operator's files (checked here, naming the flag that is wrong); HTTP/2 by ALPN. The
    /// handshake is the controller's own (`service::guard`), so that it has a deadline: a client
    /// that sends a byte and stops is dropped, not held.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, ControlError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::PrivateKeyDer;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| ControlError::Launch(format!("TLS: {e}")))?;
        let mut config = match self {
            ServerTls::FromSecret(secret) => {
                let (cert, key) = lazarus_comm::pinned::self_signed(*secret, KEY_CONTEXT, SELF_SIGNED_NAME)
                    .map_err(|e| ControlError::Launch(format!("the controller's certificate: {e}")))?;
                builder
                    .with_no_client_auth()
                    .with_single_cert(vec![cert], key)
                    .map_err(|e| ControlError::Launch(format!("the controller's certificate: {e}")))?
            }
            ServerTls::Given { cert_pem, key_pem, client_ca_pem } => {
                check_certificates(Setting::TlsCert, cert_pem)?;
                check_key(Setting::TlsKey, key_pem)?;
                let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
                    .collect::<Result<_, _>>()
                    .map_err(|e| ControlError::invalid(Setting::TlsCert, format!("not a PEM certificate ({e})")))?;
                let key = PrivateKeyDer::from_pem_slice(key_pem)
                    .map_err(|e| ControlError::invalid(Setting::TlsKey, format!("no private key in it ({e})")))?;
                let builder = match client_ca_pem {
                    None => builder.with_no_client_auth(),
                    Some(ca) => {
                        check_certificates(Setting::TlsCa, ca)?;
                        let mut roots = rustls::RootCertStore::empty();
                        for c in CertificateDer::pem_slice_iter(ca) {
                            let c = c.map_err(|e| ControlError::invalid(Setting::TlsCa, format!("not a PEM certificate ({e})")))?;
                            roots.add(c).map_err(|e| ControlError::invalid(Setting::TlsCa, format!("not a CA certificate ({e})")))?;
                        }
                        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                            .build()
                            .map_err(|e| ControlError::invalid(Setting::TlsCa, format!("cannot check clients with it ({e})")))?;
                        builder.with_client_cert_verifier(verifier)
                    }
                };
                builder.with_single_cert(chain, key).map_err(|e| {
                    ControlError::invalid(Setting::TlsCert, format!("the certificate and key do not make a TLS server: {e}"))
                })?
            }
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }

    /// What clients pin, when the certificate is the one the secret gives.
    pub fn pin(&self) -> Option<Pin> {
        match self {
            ServerTls::FromSecret(secret) => Some(pin(*secret)),
            ServerTls::Given { .. } => None,
        }
    }

    /// From the operator's files, if any (`--tls-cert` and `--tls-key` together; `--tls-ca`
    /// only with them), else from the job's `secret`.
    pub fn new(secret: u128, files: TlsFiles) -> Result<Self, ControlError> {
        match files {
            TlsFiles { cert_pem: None, key_pem: None, ca_pem: None } => Ok(ServerTls::FromSecret(secret)),
            TlsFiles { cert_pem: Some(cert_pem), key_pem: Some(key_pem), ca_pem } => {
                Ok(ServerTls::Given { cert_pem, key_pem, client_ca_pem: ca_pem })
            }
            TlsFiles { cert_pem: None, .. } => Err(ControlError::invalid(
                Setting::TlsCert,
                format!("missing: {} and {} go with the controller's certificate", Setting::TlsKey, Setting::TlsCa),
            )),
            TlsFiles { key_pem: None, .. } => {
                Err(ControlError::invalid(Setting::TlsKey, format!("missing: the key of {} is needed", Setting::TlsCert)))
            }
        }
    }
}

impl ClientTls {
    /// From the operator's files (`--tls-ca`, and `--tls-cert/--tls-key` for mutual TLS), else
    /// the pin (`pinned`: from the job's secret or a status token).
    pub fn new(pinned: Option<Pin>, files: TlsFiles) -> Result<Self, ControlError> {
        match files {
            TlsFiles { ca_pem: Some(ca_pem), cert_pem: Some(cert), key_pem: Some(key) } => {
                Ok(ClientTls::Ca { ca_pem, identity: Some((cert, key)) })
            }
            TlsFiles { ca_pem: Some(ca_pem), cert_pem: None, key_pem: None } => Ok(ClientTls::Ca { ca_pem, identity: None }),
            TlsFiles { ca_pem: Some(_), cert_pem: None, .. } => Err(ControlError::invalid(
                Setting::TlsCert,
                format!("missing: {} is this client's key, for its certificate", Setting::TlsKey),
            )),
            TlsFiles { ca_pem: Some(_), .. } => {
                Err(ControlError::invalid(Setting::TlsKey, format!("missing: the key of {} is needed", Setting::TlsCert)))
            }
            TlsFiles { ca_pem: None, cert_pem: None, key_pem: None } => pinned.map(ClientTls::Pinned).ok_or_else(|| {
                ControlError::invalid(
                    Setting::TlsCa,
                    "missing: the controller serves an operator's certificate, give the CA that signed it",
                )
            }),
            TlsFiles { ca_pem: None, .. } => Err(ControlError::invalid(
                Setting::TlsCa,
                format!(
                    "missing: a client certificate ({}/{}) is for a controller with the operator's CA",
                    Setting::TlsCert,
                    Setting::TlsKey
                ),
            )),
        }
    }

    /// An endpoint for the controller at `addr` (`host:port`) over TLS; `refused` is set when
    /// the controller fails the pin (another job's controller, a man in the middle): not worth
    /// retrying.
    pub fn endpoint(&self, addr: &str, refused: Arc<AtomicBool>) -> Result<Endpoint, ControlError> {
        let endpoint =
            Endpoint::from_shared(format!("https://{addr}")).map_err(|e| ControlError::invalid(Setting::Controller, e.to_string()))?;
        let config = ClientTlsConfig::new().assume_http2(true);
        match self {
            ClientTls::Pinned(key) => endpoint
                .tls_config_with_verifier(
                    config.domain_name(SELF_SIGNED_NAME),
                    Arc::new(PinnedKey::new(*key, "the controller", Some(refused))),
                )
                .map_err(|e| ControlError::Launch(format!("TLS to the controller: {e}"))),
            ClientTls::Ca { ca_pem, identity } => {
                check_certificates(Setting::TlsCa, ca_pem)?;
                let mut config = config.ca_certificate(Certificate::from_pem(ca_pem));
                if let Some((cert, key)) = identity {
                    check_certificates(Setting::TlsCert, cert)?;
                    check_key(Setting::TlsKey, key)?;
                    config = config.identity(Identity::from_pem(cert, key));
                }
                endpoint.tls_config(config).map_err(|e| ControlError::Launch(format!("TLS to the controller: {e}")))
            }
        }
    }
}

/// That `pem` holds at least one certificate, and nothing unreadable.
fn check_certificates(flag: Setting, pem: &[u8]) -> Result<(), ControlError> {
    use rustls::pki_types::pem::PemObject;
    let certs: Result<Vec<CertificateDer>, _> = CertificateDer::pem_slice_iter(pem).collect();
    match certs {
        Ok(c) if !c.is_empty() => Ok(()),
        Ok(_) => Err(ControlError::invalid(flag, "no certificate in it (expected PEM: -----BEGIN CERTIFICATE-----)")),
        Err(e) => Err(ControlError::invalid(flag, format!("not a PEM certificate ({e})"))),
    }
}

/// That `pem` holds a private key.
fn check_key(flag: Setting, pem: &[u8]) -> Result<(), ControlError> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(pem)
        .map(|_| ())
        .map_err(|e| ControlError::invalid(flag, format!("no private key in it (expected PEM: -----BEGIN PRIVATE KEY-----; {e})")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pin_is_the_secrets_own_and_round_trips_as_hex() {
        let (a, b) = (pin(0x5eed), pin(0x5eee));
        assert_ne!(a, b);
        assert_eq!(a, pin(0x5eed), "derived, not drawn");
        assert_eq!(parse_pin(&pin_hex(&a)), Some(a));
        assert_eq!(parse_pin(&pin_hex(&a)[..62]), None);
        assert_eq!(parse_pin(&"zz".repeat(32)), None);
        assert_eq!(parse_pin(&format!("+{}", &pin_hex(&a)[1..])), None, "hex digits only");
        // The certificate made from the secret carries the pinned key.
        let der = lazarus_comm::pinned::key_pkcs8(0x5eed, KEY_CONTEXT);
        let key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_ED25519).unwrap();
        assert_eq!(rcgen::PublicKeyData::der_bytes(&key), &a[..]);
    }

    #[test]
    fn operator_files_come_in_working_sets_or_are_refused_naming_the_flag() {
        let pem = b"-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n".to_vec();
        let files = |c: bool, k: bool, ca: bool| TlsFiles {
            cert_pem: c.then(|| pem.clone()),
            key_pem: k.then(|| pem.clone()),
            ca_pem: ca.then(|| pem.clone()),
        };
        assert!(matches!(ServerTls::new(1, files(false, false, false)), Ok(ServerTls::FromSecret(1))));
        assert!(matches!(ServerTls::new(1, files(true, true, true)), Ok(ServerTls::Given { client_ca_pem: Some(_), .. })));
        for (c, k, ca, flag) in
            [(false, true, false, Setting::TlsCert), (true, false, false, Setting::TlsKey), (false, false, true, Setting::TlsCert)]
        {
            let e = ServerTls::new(1, files(c, k, ca)).unwrap_err().to_string();
            assert!(e.starts_with(&format!("invalid {flag}")), "{e}");
        }
        assert!(matches!(ClientTls::new(Some([1; 32]), files(false, false, false)), Ok(ClientTls::Pinned(_))));
        assert!(matches!(ClientTls::new(None, files(false, false, true)), Ok(ClientTls::Ca { identity: None, .. })));
        for (c, k, ca, pinned, flag) in [
            (false, false, false, false, Setting::TlsCa),
            (true, true, false, true, Setting::TlsCa),
            (false, true, true, true, Setting::TlsCert),
            (true, false, true, true, Setting::TlsKey),
        ] {
            let e = ClientTls::new(pinned.then_some([1; 32]), files(c, k, ca)).unwrap_err().to_string();
            assert!(e.starts_with(&format!("invalid {flag}")), "{e}");
        }
        // Files that are not what they should be are named.
        let bad = ServerTls::Given { cert_pem: b"hello".to_vec(), key_pem: b"x".to_vec(), client_ca_pem: None };
        assert!(bad.acceptor().map(|_| ()).unwrap_err().to_string().starts_with(&format!("invalid {}", Setting::TlsCert)));
    }
}

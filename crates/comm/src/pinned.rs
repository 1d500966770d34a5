//! A TLS identity the job's secret gives: an Ed25519 key derived from the secret (HMAC-SHA-256
//! of it under a context of its own: the controller's gRPC channel and the ranks' data plane
//! each have theirs), a self-signed certificate for it, and the trust of a peer that must sign
//! its handshake with that key — *pinned*: the certificate says nothing more. Whoever holds the
//! secret holds the key, as they could already answer the job's challenges; a peer of another
//! job, or a man in the middle, fails the handshake.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

/// An Ed25519 public key a handshake must be signed with.
pub type Pin = [u8; 32];

/// The seed of the Ed25519 key of `context` for a job of `secret`.
fn seed(secret: u128, context: &[u8]) -> [u8; 32] {
    crate::auth::prove(secret, context, &[], &[])
}

/// The key of `context` for a job of `secret`, as PKCS#8 (v1) DER: the fixed Ed25519 header,
/// then the seed.
pub fn key_pkcs8(secret: u128, context: &[u8]) -> PrivatePkcs8KeyDer<'static> {
    const ED25519_PKCS8_V1: [u8; 16] = [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
    let mut der = ED25519_PKCS8_V1.to_vec();
    der.extend_from_slice(&seed(secret, context));
    PrivatePkcs8KeyDer::from(der)
}

/// The public key of `context` for a job of `secret`: what its peers pin.
pub fn pin(secret: u128, context: &[u8]) -> Pin {
    use ring::signature::KeyPair;
    let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed(secret, context)).expect("any 32 bytes are an Ed25519 seed");
    pair.public_key().as_ref().try_into().expect("an Ed25519 public key is 32 bytes")
}

/// A self-signed certificate named `name` for the key of `context`, with that key.
pub fn self_signed(secret: u128, context: &[u8], name: &str) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), String> {
    let der = key_pkcs8(secret, context);
    let key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_ED25519).map_err(|e| format!("the TLS key: {e}"))?;
    let cert = rcgen::CertificateParams::new(vec![name.to_string()])
        .and_then(|p| p.self_signed(&key))
        .map_err(|e| format!("the TLS certificate: {e}"))?;
    Ok((cert.der().clone(), PrivateKeyDer::Pkcs8(der)))
}

/// Trust in a peer (a server, or a client of mutual TLS) that signs the handshake with one
/// known key. `refused` is set when a peer fails it: not worth trying again.
#[derive(Debug)]
pub struct PinnedKey {
    key: Pin,
    /// Who the peer is, in what a refusal says ("the controller", "the peer").
    who: &'static str,
    refused: Option<Arc<AtomicBool>>,
}

impl PinnedKey {
    pub fn new(key: Pin, who: &'static str, refused: Option<Arc<AtomicBool>>) -> Self {
        PinnedKey { key, who, refused }
    }

    fn check(&self, message: &[u8], dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        let key = ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, &self.key);
        if dss.scheme == SignatureScheme::ED25519 && key.verify(message, dss.signature()).is_ok() {
            return Ok(HandshakeSignatureValid::assertion());
        }
        if let Some(refused) = &self.refused {
            refused.store(true, Ordering::Relaxed);
        }
        Err(rustls::Error::General(format!("{} does not hold the key the job's secret gives", self.who)))
    }

    /// Every scheme, so that a peer of another key type gets as far as signing and is told
    /// apart (refused) rather than failing the handshake without a word.
    fn schemes() -> Vec<SignatureScheme> {
        rustls::crypto::ring::default_provider().signature_verification_algorithms.supported_schemes()
    }
}

type SignatureVerdict = Result<HandshakeSignatureValid, rustls::Error>;

/// The handshake-signature checks a server's and a client's verifier share: both pin the key
/// that signs the handshake ([`PinnedKey::check`]), in TLS 1.2 and 1.3 alike.
macro_rules! signature_checks {
    () => {
        fn verify_tls12_signature(&self, message: &[u8], _: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> SignatureVerdict {
            self.check(message, dss)
        }

        fn verify_tls13_signature(&self, message: &[u8], _: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> SignatureVerdict {
            self.check(message, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            Self::schemes()
        }
    };
}

impl ServerCertVerifier for PinnedKey {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // The identity is the key that signs the handshake (checked below), not the certificate.
        Ok(ServerCertVerified::assertion())
    }

    signature_checks!();
}

impl ClientCertVerifier for PinnedKey {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    signature_checks!();
}

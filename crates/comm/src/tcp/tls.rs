//! The TLS 1.3 handshake of an encrypted data-plane connection (`--encrypt-data`), by rustls,
//! after the rendezvous' own hello has proved the job's secret both ways.
//!
//! Both ranks hold the one Ed25519 key the job's secret gives (HMAC-SHA-256 of it, a context
//! apart from every other use — the controller's key among them) and present a certificate of
//! it; each side accepts the handshake only if the other signs it with that key (mutual TLS,
//! the key pinned as on the control channel). Only TLS 1.3 and one suite,
//! TLS_AES_256_GCM_SHA384. rustls reads the handshake one whole record at a time, never past
//! its end, so the first records of data stay on the socket for the reader; then its traffic
//! secrets are taken out and each direction seals its own records ([`super::seal`]).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Instant;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{ConnectionTrafficSecrets, DigitallySignedStruct, DistinguishedName, SignatureScheme};

use super::seal::{self, Opener, Sealer, RECORD_HEADER};

/// The name in the certificate a rank makes for itself (the key is the identity).
const NAME: &str = "lazarus-rank";
/// The longest TLS record (RFC 8446 §5.2: 2^14 bytes and 256 of expansion).
const MAX_RECORD: usize = (1 << 14) + 256;

/// The TLS configurations of a job's ranks, made once per rendezvous from its secret.
pub(super) struct DataTls {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
}

/// The seed of the ranks' Ed25519 key for a job of `secret`.
fn seed(secret: u128) -> [u8; 32] {
    crate::auth::prove(secret, b"lazarus data plane tls key", &[], &[])
}

impl DataTls {
    pub(super) fn new(secret: u128) -> Result<Self, String> {
        const ED25519_PKCS8_V1: [u8; 16] = [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
        let mut der = ED25519_PKCS8_V1.to_vec();
        der.extend_from_slice(&seed(secret));
        let der = PrivatePkcs8KeyDer::from(der);
        let key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_ED25519).map_err(|e| format!("the TLS key: {e}"))?;
        let cert = rcgen::CertificateParams::new(vec![NAME.to_string()])
            .and_then(|p| p.self_signed(&key))
            .map_err(|e| format!("the TLS certificate: {e}"))?;
        let chain = vec![cert.der().clone()];
        let pinned = Arc::new(Pinned(pin(secret)));
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384];
        let provider = Arc::new(provider);
        let tls = |e: rustls::Error| format!("TLS: {e}");
        let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .dangerous()
            .with_custom_certificate_verifier(pinned.clone())
            .with_client_auth_cert(chain.clone(), PrivateKeyDer::Pkcs8(der.clone_key()))
            .map_err(tls)?;
        client.enable_secret_extraction = true;
        let mut server = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .with_client_cert_verifier(pinned)
            .with_single_cert(chain, PrivateKeyDer::Pkcs8(der))
            .map_err(tls)?;
        server.enable_secret_extraction = true;
        // No session tickets: they would be records of the server's direction before the data.
        server.send_tls13_tickets = 0;
        Ok(DataTls { client: Arc::new(client), server: Arc::new(server) })
    }

    /// The handshake of the connecting rank, by `deadline`.
    pub(super) fn connect(&self, stream: &mut TcpStream, deadline: Instant) -> Result<(Sealer, Opener), String> {
        let name = ServerName::try_from(NAME).expect("a DNS name");
        let conn = rustls::ClientConnection::new(self.client.clone(), name).map_err(|e| format!("TLS: {e}"))?;
        handshake(rustls::Connection::Client(conn), stream, deadline)
    }

    /// The handshake of the accepting rank, by `deadline`.
    pub(super) fn accept(&self, stream: &mut TcpStream, deadline: Instant) -> Result<(Sealer, Opener), String> {
        let conn = rustls::ServerConnection::new(self.server.clone()).map_err(|e| format!("TLS: {e}"))?;
        handshake(rustls::Connection::Server(conn), stream, deadline)
    }
}

/// The public key of the ranks of a job of `secret`.
fn pin(secret: u128) -> [u8; 32] {
    use ring::signature::KeyPair;
    let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed(secret)).expect("any 32 bytes are an Ed25519 seed");
    pair.public_key().as_ref().try_into().expect("an Ed25519 public key is 32 bytes")
}

/// Run `conn`'s handshake over `stream`, one whole record read at a time, then take its
/// secrets out as the two halves of the record layer.
fn handshake(mut conn: rustls::Connection, stream: &mut TcpStream, deadline: Instant) -> Result<(Sealer, Opener), String> {
    let io = |what: &str, e: std::io::Error| format!("TLS handshake: {what}: {e}");
    loop {
        while conn.wants_write() {
            stream.set_write_timeout(Some(left(deadline).map_err(|e| io("writing", e))?)).ok();
            conn.write_tls(stream).map_err(|e| io("writing", e))?;
        }
        if !conn.is_handshaking() {
            break;
        }
        let record = read_record(stream, deadline).map_err(|e| io("reading", e))?;
        let mut rest = &record[..];
        while !rest.is_empty() {
            conn.read_tls(&mut rest).map_err(|e| io("reading", e))?;
        }
        if let Err(e) = conn.process_new_packets() {
            // Tell the peer why (an alert), as far as the socket takes it.
            while conn.wants_write() && conn.write_tls(stream).is_ok() {}
            return Err(format!("TLS handshake: {e}"));
        }
    }
    stream.flush().ok();
    let secrets = conn.dangerous_extract_secrets().map_err(|e| format!("TLS: {e}"))?;
    let keys = |(seq, s): (u64, ConnectionTrafficSecrets)| match s {
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => Ok((key.as_ref().to_vec(), iv.as_ref().to_vec(), seq)),
        _ => Err("TLS: a suite other than AES-256-GCM".to_string()),
    };
    let (tx, rx) = (keys(secrets.tx)?, keys(secrets.rx)?);
    seal::halves((&tx.0, &tx.1, tx.2), (&rx.0, &rx.1, rx.2)).ok_or_else(|| "TLS: traffic keys of the wrong size".to_string())
}

/// Time left until `deadline` (an error once it has passed).
fn left(deadline: Instant) -> std::io::Result<std::time::Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::new(ErrorKind::TimedOut, "the rendezvous deadline passed"));
    }
    Ok(left)
}

/// One whole TLS record (its header and body) from `stream`, by `deadline`.
fn read_record(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<Vec<u8>> {
    let mut record = vec![0u8; RECORD_HEADER];
    read_exact_by(stream, &mut record, deadline)?;
    let len = u16::from_be_bytes([record[3], record[4]]) as usize;
    if len > MAX_RECORD {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("a TLS record of {len} bytes")));
    }
    record.resize(RECORD_HEADER + len, 0);
    read_exact_by(stream, &mut record[RECORD_HEADER..], deadline)?;
    Ok(record)
}

/// `read_exact` that gives up at `deadline` however the bytes trickle in.
pub(super) fn read_exact_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        stream.set_read_timeout(Some(left(deadline)?))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Trust in a peer that signs the handshake with the job's key (its certificate is its own
/// making and says nothing more).
#[derive(Debug)]
struct Pinned([u8; 32]);

impl Pinned {
    fn check(&self, message: &[u8], dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        let key = ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, &self.0);
        if dss.scheme == SignatureScheme::ED25519 && key.verify(message, dss.signature()).is_ok() {
            return Ok(HandshakeSignatureValid::assertion());
        }
        Err(rustls::Error::General("the peer does not hold the key the job's secret gives".into()))
    }
}

impl ServerCertVerifier for Pinned {
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

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.3 only".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        _cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.check(message, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

impl ClientCertVerifier for Pinned {
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

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.3 only".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        _cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.check(message, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Duration;

    /// One side's halves after the handshake, or its error.
    type Side = Result<(Sealer, Opener), String>;

    /// Both ends of a loopback connection after the handshake (the accepting side first).
    fn shake(server_secret: u128, client_secret: u128) -> (Side, Side) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            DataTls::new(server_secret).unwrap().accept(&mut s, deadline)
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let client = DataTls::new(client_secret).unwrap().connect(&mut c, deadline);
        // A client refused by the server learns it on its next read; close so the server's
        // side ends either way.
        drop(c);
        (server.join().unwrap(), client)
    }

    #[test]
    fn ranks_of_one_job_agree_on_keys_and_of_another_job_do_not_shake_hands() {
        let (server, client) = shake(7, 7);
        let ((mut s_seal, mut s_open), (mut c_seal, mut c_open)) = (server.unwrap(), client.unwrap());
        for (seal, open) in [(&mut c_seal, &mut s_open), (&mut s_seal, &mut c_open)] {
            let wire = seal.seal_frame(&[3u8; 28], &[]).to_vec();
            let head: [u8; RECORD_HEADER] = wire[..RECORD_HEADER].try_into().unwrap();
            let mut body = wire[RECORD_HEADER..].to_vec();
            assert_eq!(open.open(&head, &mut body, 28), Ok(28), "each direction opens what the other sealed");
            assert_eq!(&body[..28], &[3u8; 28]);
        }
        let (server, _) = shake(7, 8);
        let e = server.err().expect("a peer with another job's key is refused");
        assert!(e.contains("TLS handshake"), "{e}");
    }
}

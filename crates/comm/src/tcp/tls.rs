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

use rustls::pki_types::ServerName;
use rustls::ConnectionTrafficSecrets;

use super::seal::{self, Opener, Sealer, RECORD_HEADER};
use crate::pinned::{self, PinnedKey};

/// The name in the certificate a rank makes for itself (the key is the identity).
const NAME: &str = "lazarus-rank";
/// The longest TLS record (RFC 8446 §5.2: 2^14 bytes and 256 of expansion).
const MAX_RECORD: usize = (1 << 14) + 256;

/// The TLS configurations of a job's ranks, made once per rendezvous from its secret.
pub(super) struct DataTls {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
}

/// The context of the ranks' key: one apart from the controller's.
const KEY_CONTEXT: &[u8] = b"lazarus data plane tls key";

impl DataTls {
    pub(super) fn new(secret: u128) -> Result<Self, String> {
        let (cert, key) = pinned::self_signed(secret, KEY_CONTEXT, NAME)?;
        let chain = vec![cert];
        let pinned = Arc::new(PinnedKey::new(pinned::pin(secret, KEY_CONTEXT), "the peer", None));
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384];
        let provider = Arc::new(provider);
        let tls = |e: rustls::Error| format!("TLS: {e}");
        let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .dangerous()
            .with_custom_certificate_verifier(pinned.clone())
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .map_err(tls)?;
        client.enable_secret_extraction = true;
        let mut server = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls)?
            .with_client_cert_verifier(pinned)
            .with_single_cert(chain, key)
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

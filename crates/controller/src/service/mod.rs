//! The controller's gRPC service (`proto/lazarus_control.proto`, `tonic`): `Status` — what the
//! controller of a running job knows (membership, epoch, plan, recent events) for `lazarus
//! status` — and `Attach`, the node agents' sessions, handed to the [`crate::hub`]. The
//! controller's loop publishes a [`snapshot`] after each decision; the server only hands out
//! the latest. [`query`] is the client side of `lazarus status`.

use lazarus_setting::Setting;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::decisions::{Controller, MemberState};
use crate::hub::{AgentHub, AgentStream};
use lazarus_protocol::rpc::{error_chain, runtime, status_error};
use lazarus_protocol::tls::{ClientTls, ServerTls};
use lazarus_protocol::ControlError;

mod guard;

use lazarus_protocol::proto::control_server::{Control, ControlServer};
use lazarus_protocol::proto::{self, Member, StatusReply, StatusRequest};

/// How long a stopping server waits for open sessions to end.
const STOP_GRACE: Duration = Duration::from_secs(1);

/// The latest status, shared by the controller's loop (writer) and the server (reader).
pub type SharedStatus = Arc<Mutex<StatusReply>>;

/// What `ctl` knows at `now`, for job `job_id` that started at epoch `first_epoch`; its plan
/// as `plan` (the caller keeps it from one epoch to the next: it changes only with one).
pub fn snapshot(ctl: &Controller, now: Instant, job_id: &str, first_epoch: u64, plan: Option<proto::Plan>) -> StatusReply {
    let rank_of: std::collections::HashMap<u64, u64> = ctl.ranks().iter().enumerate().map(|(r, &n)| (n, r as u64)).collect();
    let members = ctl
        .nodes()
        .map(|node| Member {
            node,
            // A member not heard from yet is expected, not known to be alive.
            alive: ctl.alive().contains(&node) && ctl.member_state(node) != MemberState::Starting,
            rank: rank_of.get(&node).copied(),
            silent_s: ctl.last_heard(node).map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64()),
            epoch: ctl.node_epoch(node).map_or(0, |e| e.saturating_sub(first_epoch)),
            state: ctl.member_state(node).as_str().to_string(),
        })
        .collect();
    StatusReply {
        job_id: job_id.to_string(),
        epoch: ctl.epoch().saturating_sub(first_epoch),
        phase: ctl.phase_name().to_string(),
        step: ctl.last_step(),
        members,
        plan,
        recent: ctl.recent().cloned().collect(),
        last_checkpoint: ctl.checkpoint(),
        lease_s: ctl.lease().as_secs_f64(),
        reconfigurations: ctl.reconfigurations(),
    }
}

/// How far a status request's clock may be from the controller's.
const STATUS_WINDOW_MS: u64 = 5 * 60 * 1000;
/// Most nonces of recent status requests kept (to refuse a replay).
const STATUS_NONCES: usize = 100_000;

/// The read-only key `lazarus status` proves: derived from the job's secret, so that whoever
/// holds the secret file can ask, and a key printed for a job of local workers grants nothing
/// else.
pub fn status_key(secret: u128) -> u128 {
    let d = lazarus_comm::auth::prove(secret, b"lazarus status key", &[], &[]);
    u128::from_le_bytes(d[..16].try_into().expect("16 of 32 bytes"))
}

/// What `lazarus status` needs of a controller serving `tls`, in one line to print: the status
/// key (32 hex digits) and, when the certificate is the one the job's secret gives, the key it
/// pins (`.` and 64 hex digits). Without a pin, the client checks the operator's CA instead.
pub fn status_token(key: u128, tls: &ServerTls) -> String {
    match tls.pin() {
        Some(pin) => format!("{}.{}", lazarus_protocol::secret_hex(key), lazarus_protocol::tls::pin_hex(&pin)),
        None => lazarus_protocol::secret_hex(key),
    }
}

/// The status key and pin a [`status_token`] holds; None if it is not one.
pub fn parse_status_token(token: &str) -> Option<(u128, Option<lazarus_protocol::tls::Pin>)> {
    let (key, pin) = match token.split_once('.') {
        Some((k, p)) => (k, Some(lazarus_protocol::tls::parse_pin(p)?)),
        None => (token, None),
    };
    let key = u128::from_str_radix(key, 16).ok().filter(|_| key.len() == 32 && !key.starts_with('+'))?;
    Some((key, pin))
}

fn unix_ms() -> u64 {
    lazarus_protocol::when::unix_ms_now()
}

/// A status request proving `key`: the clock, a fresh nonce, the proof.
pub fn status_request(key: u128) -> Result<StatusRequest, ControlError> {
    let nonce = lazarus_comm::auth::nonce().map_err(|e| ControlError::io("drawing a nonce from /dev/urandom", e))?;
    let unix_ms = unix_ms();
    let proof = lazarus_comm::auth::prove(key, b"lazarus status request", &unix_ms.to_le_bytes(), &nonce).to_vec();
    Ok(StatusRequest { nonce: nonce.to_vec(), unix_ms, proof })
}

/// Whether `r` proves `key`, is within the clock window, and was not seen before (`seen`, the
/// recent nonces with their clocks).
fn status_request_ok(
    key: u128,
    r: &StatusRequest,
    now_ms: u64,
    seen: &mut std::collections::VecDeque<(u64, Vec<u8>)>,
) -> Result<(), String> {
    if r.nonce.len() != lazarus_comm::auth::NONCE
        || !lazarus_comm::auth::verify(key, b"lazarus status request", &r.unix_ms.to_le_bytes(), &r.nonce, &r.proof)
    {
        return Err(format!(
            "the request does not prove the job's status key (give {}, or LAZARUS_STATUS_TOKEN as the controller printed it)",
            Setting::SecretFile
        ));
    }
    if r.unix_ms.abs_diff(now_ms) > STATUS_WINDOW_MS {
        return Err(format!("the request's clock is {} s from the controller's (at most 300)", r.unix_ms.abs_diff(now_ms) / 1000));
    }
    while seen.front().is_some_and(|(t, _)| t.saturating_add(2 * STATUS_WINDOW_MS) < now_ms) || seen.len() >= STATUS_NONCES {
        seen.pop_front();
    }
    if seen.iter().any(|(_, n)| *n == r.nonce) {
        return Err("a request seen before (replayed)".into());
    }
    seen.push_back((now_ms, r.nonce.clone()));
    Ok(())
}

struct Service {
    status: SharedStatus,
    hub: Option<Arc<AgentHub>>,
    status_key: u128,
    seen: Mutex<std::collections::VecDeque<(u64, Vec<u8>)>>,
}

#[tonic::async_trait]
impl Control for Service {
    async fn status(&self, request: tonic::Request<StatusRequest>) -> Result<tonic::Response<StatusReply>, tonic::Status> {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        status_request_ok(self.status_key, request.get_ref(), unix_ms(), &mut seen).map_err(tonic::Status::unauthenticated)?;
        drop(seen);
        let reply = self.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Ok(tonic::Response::new(reply))
    }

    type AttachStream = AgentStream;

    async fn attach(
        &self,
        request: tonic::Request<tonic::Streaming<proto::AgentMessage>>,
    ) -> Result<tonic::Response<Self::AttachStream>, tonic::Status> {
        let Some(hub) = &self.hub else {
            return Err(tonic::Status::failed_precondition(format!(
                "this controller starts its workers itself (train {} without {}): it takes no agents",
                Setting::Workers,
                Setting::GpusPerNode
            )));
        };
        let peer = request.remote_addr();
        let stream = hub.clone().attach(peer, request.into_inner()).await?;
        Ok(tonic::Response::new(stream))
    }
}

/// The gRPC service of a running controller (status, and the agents' sessions when it has a
/// hub); stops when dropped.
pub struct GrpcServer {
    server: crate::server_thread::ServerThread,
}

impl GrpcServer {
    /// Serve `status` to whoever proves `status_key` (and `hub`'s agents) on `listen` (port 0:
    /// any free port) from a thread of its own.
    /// `tls` says which certificate it serves.
    pub fn start(
        listen: SocketAddr,
        status: SharedStatus,
        hub: Option<Arc<AgentHub>>,
        status_key: u128,
        tls: &ServerTls,
    ) -> Result<Self, ControlError> {
        let flag = if hub.is_some() { Setting::Listen } else { Setting::StatusListen };
        // TLS is the guard's (`guard::incoming`): its handshake has a deadline.
        let builder = tonic::transport::Server::builder();
        let acceptor = tls.acceptor()?;
        let listener = TcpListener::bind(listen).map_err(|e| ControlError::io(format!("{flag}: binding {listen}"), e))?;
        let addr = listener.local_addr().map_err(|e| ControlError::io("reading the status address", e))?;
        listener.set_nonblocking(true).map_err(|e| ControlError::io("the status listener", e))?;
        let runtime = runtime(2, "lazarus-control")?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let thread = std::thread::Builder::new()
            .name("lazarus-status".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => return tracing::warn!("status server: {e}"),
                    };
                    let incoming = guard::incoming(listener, acceptor);
                    let (mut graceful, mut hard) = (stopped.clone(), stopped);
                    // Keepalives find the dead peers of open sessions.
                    let serve = builder
                        .http2_keepalive_interval(Some(Duration::from_secs(10)))
                        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
                        .add_service(ControlServer::new(Service { status, hub, status_key, seen: Mutex::new(Default::default()) }))
                        .serve_with_incoming_shutdown(incoming, async move {
                            let _ = graceful.wait_for(|&s| s).await;
                        });
                    // A session that cannot end (an agent cut off by a partition) must not hold
                    // the controller's exit: once told to stop, the server gets a second.
                    let served = tokio::select! {
                        r = serve => r,
                        _ = async move {
                            let _ = hard.wait_for(|&s| s).await;
                            tokio::time::sleep(STOP_GRACE).await;
                        } => Ok(()),
                    };
                    if let Err(e) = served {
                        tracing::warn!("status server: {e}");
                    }
                });
            })
            .map_err(|e| ControlError::io("starting the status server", e))?;
        Ok(GrpcServer { server: crate::server_thread::ServerThread::new(addr, stop, thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }
}

/// Ask the controller at `addr` (`host:port`) for its status over TLS (trusting it as `tls`
/// says), proving the job's status `key`, waiting at most `timeout`.
pub fn query(addr: &str, timeout: Duration, key: u128, tls: &ClientTls) -> Result<StatusReply, ControlError> {
    let request = status_request(key)?;
    let parsed = addr
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| ControlError::invalid(Setting::Controller, format!("{addr:?} (expected host:port, e.g. 127.0.0.1:7070)")))?;
    let refused = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let endpoint = tls.endpoint(addr, refused.clone())?.connect_timeout(timeout).timeout(timeout);
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| ControlError::io("starting a runtime", e))?;
    runtime.block_on(async move {
        let asked = async {
            let channel = endpoint.connect().await.map_err(|e| {
                if refused.load(std::sync::atomic::Ordering::Relaxed) {
                    ControlError::Launch(format!("the server at {parsed} is not this job's controller: it does not hold the key the job's secret (or the status token) gives; a controller serving an operator's certificate needs {}", Setting::TlsCa))
                } else {
                    ControlError::Launch(format!("cannot reach the controller at {parsed} over TLS: {}", error_chain(&e)))
                }
            })?;
            // A status lists every member and the plan: megabytes at a thousand nodes.
            let mut client = proto::control_client::ControlClient::new(channel).max_decoding_message_size(lazarus_protocol::MAX_CONTROL_MESSAGE);
            let reply = client
                .status(request)
                .await
                .map_err(|e| {
                    // A controller of mutual TLS closes the connection of a client it does not
                    // take, and that is all the client sees.
                    let hint = match tls {
                        ClientTls::Ca { .. } => format!(
                            "; a controller that asks for client certificates takes only those its CA signed ({}/{})",
                            Setting::TlsCert,
                            Setting::TlsKey
                        ),
                        ClientTls::Pinned(_) => String::new(),
                    };
                    ControlError::Launch(format!("the controller at {parsed} did not answer: {}{hint}", status_error(&e)))
                })?;
            Ok(reply.into_inner())
        };
        tokio::time::timeout(timeout, asked)
            .await
            .map_err(|_| ControlError::Launch(format!("no answer from {parsed} within {} s", timeout.as_secs_f64())))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_request_proves_the_key_once_within_the_clock_window() {
        let key = status_key(0x5eed);
        assert_ne!(key, 0x5eed, "the status key is not the secret");
        let mut seen = Default::default();
        let r = status_request(key).unwrap();
        let now = r.unix_ms;
        assert!(status_request_ok(key, &r, now, &mut seen).is_ok());
        assert!(status_request_ok(key, &r, now, &mut seen).unwrap_err().contains("replayed"));
        let other = status_request(status_key(0x5eee)).unwrap();
        assert!(status_request_ok(key, &other, now, &mut seen).unwrap_err().contains("does not prove"));
        let late = status_request(key).unwrap();
        assert!(status_request_ok(key, &late, now + 6 * 60 * 1000, &mut seen).unwrap_err().contains("clock"));
        let cut = StatusRequest { proof: late.proof[..8].to_vec(), ..late };
        assert!(status_request_ok(key, &cut, now, &mut seen).is_err());
    }

    #[test]
    fn a_status_token_carries_the_key_and_the_pin_when_the_secret_gives_the_certificate() {
        let tls = ServerTls::FromSecret(0x5eed);
        let token = status_token(7, &tls);
        assert_eq!(parse_status_token(&token), Some((7, tls.pin())));
        let given = ServerTls::Given { cert_pem: vec![], key_pem: vec![], client_ca_pem: None };
        assert_eq!(parse_status_token(&status_token(7, &given)), Some((7, None)));
        for bad in ["", "7", &token[..40], &format!("{token}0"), &token.replace('.', ":"), &format!("+{}", &token[1..])] {
            assert_eq!(parse_status_token(bad), None, "{bad:?}");
        }
    }
}

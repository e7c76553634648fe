//! lbscale-node: the data-plane node of lbscale's `local` cloud, and the local
//! cloud's DNS and L4 (nlb) traffic distributors.

mod api;
mod api_tls;
mod bounds;
mod cancel;
mod clock;
mod dial;
mod dns;
mod health;
mod http;
mod lb;
mod listener;
mod metrics;
mod model;
mod nlb;
mod node;
mod persist;
mod proxy_protocol;
mod scaleout;
mod service;
mod slowstart;
mod tcp;
mod udp;
mod upstream;
mod usage;
mod watch;
mod window;

#[cfg(test)]
mod balancing_tests;
#[cfg(test)]
mod module_graph_tests;

use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context};

const USAGE: &str = "\
usage:
  lbscale-node serve --node-id ID --listen-ip IP --api-port PORT --token-file PATH --tls-ca PATH --tls-cert PATH --tls-key PATH [--api-address IP] [--stats instance|process] [--memory-limit-mb N] [NODE OPTIONS]
  lbscale-node dns --listen IP:PORT --config FILE --status FILE
  lbscale-node nlb --config FILE --status FILE
  lbscale-node standalone --listen IP:PORT --mode http|tcp|udp --lb-method METHOD --service HOST:PORT[,WEIGHT] [--service ...] [--persistence NONE|COOKIE|SOURCEIP] [NODE OPTIONS]

serve's management API listens on --listen-ip, port --api-port, over TLS only:
  --token-file PATH  this node's bearer token, or sha256:HEX, the SHA-256 of the
                     token (64 hex digits), so that the file need not hold the secret
  --tls-ca PATH      the group CA's certificate (PEM): a client must show a client
                     certificate that it issued (the engine's)
  --tls-cert PATH    this node's certificate (PEM), --tls-key PATH its private key
  --api-address IP   this node's private address: a call made to any other address
                     is refused (default --listen-ip; needed when that is 0.0.0.0 or ::)

serve's --stats says whose CPU and memory GetStats reports, each the mean over
the window the caller asks for (the group's stats interval):
  instance (default)  the machine's: CPU over all cores from /proc/stat (0-100),
                      used memory over /proc/meminfo's total, or over the
                      cgroup's memory limit when one binds (a container)
  process             this process's: CPU as a share of one core (above 100 on
                      several cores), resident memory over --memory-limit-mb
                      (needed then); the local cloud's, where nodes share a machine

node options (serve, standalone):
  --health-interval-ms N   TCP-connect health check of every service every N ms (default 1000; 0 = off)
  --health-fall K          consecutive failures that take a service DOWN (default 3)
  --health-rise K          consecutive successes that bring it UP again (default 2)
  --service-drain-timeout-ms N  a disabled or removed service's connections may go on
                           for N ms, then close (default 30000)
  --persistence-timeout-ms N  SOURCEIP persistence: a client's entry expires after N ms
                           without use (default 120000)
  --custom-load-file PATH  JSON object of CUSTOMLOAD values, {\"vserver/service\": load} or
                           {\"service\": load}; polled every 200 ms
  --connect-timeout-ms N   connecting to a service may take N ms (default 5000)
  --response-header-timeout-ms N  a service's response headers must come within N ms
                           of the request (HTTP; default 60000; 504 after)
  --max-request-header-bytes N  a request's line and headers may take N bytes
                           (HTTP; default 32768, at least 8192; 431 past it)
  --threads N              threads that serve traffic (default: one per core the
                           process may run on; 1: one event loop, as HAProxy's nbthread 1)

The node raises its soft open-files limit to the hard one, keeps an eighth of
it (at least 128) for its API and checks, and admits connections and UDP flows
only within the rest.
";

const NODE_OPTS: [&str; 10] = [
    "service-drain-timeout-ms",
    "persistence-timeout-ms",
    "health-interval-ms",
    "health-fall",
    "health-rise",
    "custom-load-file",
    "connect-timeout-ms",
    "response-header-timeout-ms",
    "max-request-header-bytes",
    "threads",
];

fn node_opts(a: &Args) -> anyhow::Result<node::NodeOpts> {
    let mut o = node::NodeOpts::default();
    let num = |k: &str| -> anyhow::Result<Option<u64>> {
        match a.get(k) {
            Ok(v) => {
                Ok(Some(v.parse().with_context(|| {
                    format!("--{k} must be a whole number")
                })?))
            }
            Err(_) => Ok(None),
        }
    };
    if let Some(ms) = num("service-drain-timeout-ms")? {
        o.service_drain = std::time::Duration::from_millis(ms);
    }
    if let Some(ms) = num("persistence-timeout-ms")? {
        if ms == 0 {
            bail!("--persistence-timeout-ms must be 1 or more");
        }
        o.persistence_timeout = std::time::Duration::from_millis(ms);
    }
    if let Some(ms) = num("health-interval-ms")? {
        o.health.interval = std::time::Duration::from_millis(ms);
    }
    if let Some(k) = num("health-fall")? {
        o.health.fall = (k as u32).max(1);
    }
    if let Some(k) = num("health-rise")? {
        o.health.rise = (k as u32).max(1);
    }
    let positive_ms = |k: &str| -> anyhow::Result<Option<std::time::Duration>> {
        match num(k)? {
            Some(0) => bail!("--{k} must be 1 or more"),
            v => Ok(v.map(std::time::Duration::from_millis)),
        }
    };
    if let Some(d) = positive_ms("connect-timeout-ms")? {
        o.limits.connect_timeout = d;
    }
    if let Some(d) = positive_ms("response-header-timeout-ms")? {
        o.limits.response_header_timeout = d;
    }
    if let Some(n) = num("max-request-header-bytes")? {
        if n < bounds::MIN_REQUEST_HEADER_BYTES as u64 {
            bail!(
                "--max-request-header-bytes must be {} or more",
                bounds::MIN_REQUEST_HEADER_BYTES
            );
        }
        o.limits.max_request_header_bytes = n as usize;
    }
    Ok(o)
}

fn start_custom_loads(a: &Args, node: &Arc<node::Node>) {
    if let Ok(p) = a.get("custom-load-file") {
        tokio::spawn(node.clone().watch_custom_loads(PathBuf::from(p)));
    }
}

struct Args {
    opts: HashMap<String, Vec<String>>,
}

impl Args {
    fn parse(args: &[String], allowed: &[&str]) -> anyhow::Result<Args> {
        let mut opts: HashMap<String, Vec<String>> = HashMap::new();
        let mut i = 0;
        while i < args.len() {
            let a = &args[i];
            let Some(key) = a.strip_prefix("--") else {
                bail!("unexpected argument {a:?}")
            };
            let (key, value) = match key.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => {
                    i += 1;
                    let v = args
                        .get(i)
                        .ok_or_else(|| anyhow!("--{key} needs a value"))?;
                    (key.to_string(), v.clone())
                }
            };
            if !allowed.contains(&key.as_str()) {
                bail!("unknown option --{key}");
            }
            opts.entry(key).or_default().push(value);
            i += 1;
        }
        Ok(Args { opts })
    }

    fn get(&self, key: &str) -> anyhow::Result<&str> {
        self.opts
            .get(key)
            .and_then(|v| v.last())
            .map(|s| s.as_str())
            .ok_or_else(|| anyhow!("missing --{key}"))
    }

    fn all(&self, key: &str) -> Vec<String> {
        self.opts.get(key).cloned().unwrap_or_default()
    }
}

/// Tells the launcher we are listening. A closed stdout is not fatal.
fn announce_ready() {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready");
    let _ = out.flush();
}

/// Registers SIGTERM/SIGINT handlers now (so that a signal arriving early is not
/// fatal) and returns a future that resolves when one arrives.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: exiting"),
            _ = int.recv() => tracing::info!("SIGINT: exiting"),
        }
    }
}

/// serve's `--stats` (and `--memory-limit-mb`, which `process` needs).
fn stats_source(a: &Args) -> anyhow::Result<usage::Source> {
    let limit = match a.get("memory-limit-mb") {
        Ok(v) => Some(
            v.parse::<u64>()
                .context("--memory-limit-mb must be a whole number")?,
        ),
        Err(_) => None,
    };
    match a.get("stats").unwrap_or("instance") {
        "instance" => Ok(usage::Source::Instance),
        "process" => match limit {
            Some(memory_limit_mb) if memory_limit_mb > 0 => {
                Ok(usage::Source::Process { memory_limit_mb })
            }
            _ => bail!("--stats process needs --memory-limit-mb N (1 or more)"),
        },
        s => bail!("--stats must be instance or process, not {s:?}"),
    }
}

async fn serve(a: Args) -> anyhow::Result<()> {
    let node_id = a.get("node-id")?.to_string();
    let ip: IpAddr = a
        .get("listen-ip")?
        .parse()
        .context("--listen-ip must be an IP address")?;
    let api_port: u16 = a
        .get("api-port")?
        .parse()
        .context("--api-port must be a port number")?;
    let token_file = PathBuf::from(a.get("token-file")?);
    let stats_source = stats_source(&a)?;
    let token = std::fs::read_to_string(&token_file)
        .with_context(|| format!("cannot read token file {}", token_file.display()))?
        .trim()
        .to_string();
    if token.is_empty() {
        bail!("token file {} is empty", token_file.display());
    }
    let token = api::ExpectedToken::parse(&token)
        .map_err(|e| anyhow!("token file {}: {e}", token_file.display()))?;
    let api_address: IpAddr = match a.get("api-address") {
        Ok(v) => v.parse().context("--api-address must be an IP address")?,
        Err(_) if ip.is_unspecified() => bail!(
            "--api-address is needed when --listen-ip is {ip}: the node's private address, the only one its API answers at"
        ),
        Err(_) => ip,
    };
    let tls = api_tls::server_config(
        Path::new(a.get("tls-ca")?),
        Path::new(a.get("tls-cert")?),
        Path::new(a.get("tls-key")?),
    )?;
    let node = node::Node::new(node_id.clone(), ip, stats_source, node_opts(&a)?);
    start_custom_loads(&a, &node);
    let addr = SocketAddr::new(ip, api_port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let stats = api::StatsCall {
        node: node.clone(),
        expected: token.clone(),
        address: api_address,
    };
    let incoming = api::incoming(listener, tls, stats);
    let svc = lbscale_proto::node_api_server::NodeApiServer::with_interceptor(
        api::Api { node: node.clone() },
        api::interceptor(token, api_address),
    );
    tracing::info!(node_id = %node_id, api = %addr, "node API listening");
    let stop = shutdown_signal();
    announce_ready();
    tokio::select! {
        r = tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming) => {
            r.map_err(|e| anyhow!("api server: {e}"))?;
            bail!("api server stopped");
        }
        _ = stop => {}
    }
    Ok(())
}

/// `standalone`'s `--service HOST:PORT[,WEIGHT]` options.
fn standalone_services(a: &Args) -> anyhow::Result<Vec<lbscale_proto::Service>> {
    use lbscale_proto::Service;
    let mut services = Vec::new();
    for s in a.all("service") {
        let (hp, weight) = match s.split_once(',') {
            Some((hp, w)) => (
                hp,
                w.parse::<u32>()
                    .ok()
                    .filter(|w| *w >= 1)
                    .ok_or_else(|| anyhow!("--service {s:?}: weight must be 1 or more"))?,
            ),
            None => (s.as_str(), 1),
        };
        let (host, port) = hp
            .rsplit_once(':')
            .ok_or_else(|| anyhow!("--service {s:?} must be HOST:PORT"))?;
        services.push(Service {
            name: hp.to_string(),
            address: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port: port
                .parse()
                .with_context(|| format!("--service {s:?}: bad port"))?,
            weight,
            enabled: true,
            cap_per_second: None,
            custom_load: None,
        });
    }
    if services.is_empty() {
        bail!("at least one --service HOST:PORT is needed");
    }
    Ok(services)
}

async fn standalone(a: Args) -> anyhow::Result<()> {
    use lbscale_proto::{LbMethod, NodeConfig, ServiceType, Vserver};
    let listen: SocketAddr = a
        .get("listen")?
        .parse()
        .context("--listen must be IP:PORT")?;
    let mode = match a.get("mode")?.to_ascii_lowercase().as_str() {
        "http" => ServiceType::Http,
        "tcp" => ServiceType::Tcp,
        "udp" => ServiceType::Udp,
        m => bail!("--mode must be http, tcp or udp, not {m:?}"),
    };
    let method = a
        .get("lb-method")
        .unwrap_or("ROUNDROBIN")
        .to_ascii_uppercase();
    let method =
        LbMethod::from_str_name(&method).ok_or_else(|| anyhow!("unknown --lb-method {method}"))?;
    let services = standalone_services(&a)?;
    let stop = shutdown_signal();
    // Nothing reads a standalone node's statistics.
    let stats = usage::Source::Process { memory_limit_mb: 0 };
    let node = node::Node::new("standalone".into(), listen.ip(), stats, node_opts(&a)?);
    start_custom_loads(&a, &node);
    node.configure(NodeConfig {
        group_peers: Vec::new(),
        fence: 0,
        version: 1,
        vservers: vec![Vserver {
            name: "standalone".into(),
            service_type: mode as i32,
            port: listen.port() as u32,
            lb_method: method as i32,
            persistence: a.get("persistence").unwrap_or("NONE").to_string(),
            services,
            slow_start: None,
            scaleout: None,
            ramp_peers: vec![],
            ..Default::default()
        }],
    })
    .await
    .map_err(|e| anyhow!("{}", e.message()))?;
    let _keep: Arc<node::Node> = node;
    tracing::info!(%listen, "standalone vserver listening");
    announce_ready();
    stop.await;
    Ok(())
}

/// The options of command `cmd`.
fn parse_args(cmd: &str, rest: &[String]) -> anyhow::Result<Args> {
    match cmd {
        "serve" => Args::parse(
            rest,
            &[
                &[
                    "node-id",
                    "listen-ip",
                    "api-port",
                    "token-file",
                    "tls-ca",
                    "tls-cert",
                    "tls-key",
                    "api-address",
                    "memory-limit-mb",
                    "stats",
                ][..],
                &NODE_OPTS[..],
            ]
            .concat(),
        ),
        "dns" => Args::parse(rest, &["listen", "config", "status"]),
        "nlb" => Args::parse(rest, &["config", "status"]),
        "standalone" => Args::parse(
            rest,
            &[
                &["listen", "mode", "lb-method", "service", "persistence"][..],
                &NODE_OPTS[..],
            ]
            .concat(),
        ),
        _ => Err(anyhow!("unknown command {cmd:?}")),
    }
}

/// Runs command `cmd` until it ends or a signal stops it.
async fn run(cmd: String, a: Args) -> anyhow::Result<()> {
    let stop = shutdown_signal();
    match cmd.as_str() {
        "serve" => serve(a).await,
        "standalone" => standalone(a).await,
        "dns" => {
            let listen: SocketAddr = a
                .get("listen")?
                .parse()
                .context("--listen must be IP:PORT")?;
            let config = PathBuf::from(a.get("config")?);
            let status = PathBuf::from(a.get("status")?);
            tokio::select! {
                r = dns::run(listen, config, status) => r,
                _ = stop => Ok(()),
            }
        }
        "nlb" => {
            let config = PathBuf::from(a.get("config")?);
            let status = PathBuf::from(a.get("status")?);
            tokio::select! {
                _ = nlb::run(config, status) => Ok(()),
                _ = stop => Ok(()),
            }
        }
        _ => unreachable!("checked above"),
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    bounds::raise_open_files_limit();
    let argv: Vec<String> = std::env::args().collect();
    let Some(cmd) = argv.get(1).map(|s| s.as_str()) else {
        eprint!("{USAGE}");
        std::process::exit(2);
    };
    if matches!(cmd, "-h" | "--help" | "help") {
        print!("{USAGE}");
        return;
    }
    let parsed = parse_args(cmd, &argv[2..]);
    let a = match parsed {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lbscale-node: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    // One core available (e.g. `taskset -c 1`) or one thread asked for: a
    // current-thread runtime, which saves the multi-thread scheduler's
    // cross-thread wake-ups and atomics.
    let threads = match a.get("threads") {
        Ok(v) => {
            match v.parse::<usize>() {
                Ok(n) if n >= 1 => n,
                _ => {
                    eprintln!("lbscale-node: --threads must be a whole number, 1 or more, got {v:?}\n{USAGE}");
                    std::process::exit(2);
                }
            }
        }
        Err(_) => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    };
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    let rt = builder.enable_all().build().expect("tokio runtime");
    let r = rt.block_on(run(cmd.to_string(), a));
    match r {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::exit(1);
        }
    }
}

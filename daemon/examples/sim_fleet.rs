//! A fleet of simulated nodes for the daemon's benchmark at scale
//! (bench/daemon_scale.sh): thousands of groups whose nodes are served from one
//! process, behind the real node management API.
//!
//! ```text
//! sim_fleet setup  URL GROUPS PORT [INTERVAL] [HOT]  # write the groups into the store
//! sim_fleet nodes  URL PORT [HOT]                    # serve every node's API
//! sim_fleet daemon URL LISTEN PORT                   # `lbscale daemon`, nodes simulated
//! ```
//!
//! - `setup` writes GROUPS groups straight into the store (no Terraform, no
//!   provisioning): each with its own DNS distributor, 3 AZs and 2 active,
//!   registered nodes per AZ (min 2, max 3 per AZ), each node at an address of
//!   its own in 127.100.0.0/16 with its API on PORT. A group's secret is made
//!   as the engine makes it; nothing else is derived here.
//! - `nodes` serves the API of every node in the store on one wildcard listener
//!   (0.0.0.0:PORT, loopback connections only): it tells nodes apart by the
//!   address a connection was made to, and does what a node does: TLS with a
//!   server certificate of the group's CA (derived from the group secret, for
//!   the node's name, which the client's SNI must name), the engine's client
//!   certificate required (verified against that CA), the node's own token on
//!   every call. Nodes report idle-ish statistics (cpu 50 %, inside the
//!   groups' 10..90 band: no scaling) except those of the first HOT groups
//!   (cpu 95 %: they scale out to max). New nodes (a scale-out) are picked up
//!   from the store every few seconds.
//! - `daemon` runs the daemon's own code (`lbscale_daemon::run_with_clouds`)
//!   with a cloud of simulated nodes under the name `local`: provisioning
//!   reserves an address in 127.101.0.0/16 (in the store, as the local cloud
//!   does) and the nodes answer through `nodes`; every node is alive; the
//!   distributors publish nothing. Claims, resumes, sampling over TLS, the
//!   policy, the persisted state and the workflows are the daemon's and the
//!   engine's.

use lbscale_engine::cloud::{
    CloudError, Clouds, Distributor, DriverStore, Drivers, ProvisionRequest, Provisioned,
    Publication,
};
use lbscale_engine::model::{
    CloudName, DeclaredDuration, DistributorMode, DistributorSpec, GroupSpec, Metric, ThresholdSpec,
};
use lbscale_engine::nodeapi::auth::{bearer, node_name, GroupCa};
use lbscale_engine::nodeapi::node_server_config;
use lbscale_engine::store::{now_ms, NodeRow, NodeState, Store};
use lbscale_proto::node_api_server::{NodeApi, NodeApiServer};
use lbscale_proto::stats_http;
use lbscale_proto::{
    ConfigureReply, DrainReply, DrainRequest, NodeConfig, NodeStats, StatsRequest, AUTH_HEADER,
};
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tonic::{Request, Response, Status};

const AZS: [&str; 3] = ["az1", "az2", "az3"];
const NODES_PER_AZ: usize = 2;

fn usage() -> ! {
    eprintln!(
        "usage: sim_fleet setup URL GROUPS PORT [INTERVAL] [HOT] | nodes URL PORT [HOT] | daemon URL LISTEN PORT"
    );
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let base = std::env::current_dir().expect("current directory");
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["setup", url, n, port, rest @ ..] => {
            let interval = rest.first().copied().unwrap_or("60s");
            setup(
                url,
                &base,
                n.parse().expect("GROUPS"),
                port.parse().expect("PORT"),
                interval,
            )
        }
        ["nodes", url, port, rest @ ..] => {
            let hot = rest.first().map_or(0, |h| h.parse().expect("HOT"));
            runtime(2).block_on(nodes(url, base, port.parse().expect("PORT"), hot))
        }
        ["daemon", url, listen, port] => {
            init_logs();
            let cfg = lbscale_daemon::DaemonConfig::new(url, base, listen.parse().expect("LISTEN"));
            let port: u16 = port.parse().expect("PORT");
            let clouds: Clouds = lbscale_daemon::default_clouds(&cfg).with("local", move |store| {
                Ok(Drivers::of(SimCloud { store, port }))
            });
            // As `lbscale daemon` runs it: its allocator settings, two worker
            // threads.
            lbscale_daemon::malloc::tune();
            let r = runtime(2).block_on(lbscale_daemon::run_with_clouds(cfg, clouds, async {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .expect("SIGTERM handler");
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }));
            if let Err(e) = r {
                eprintln!("sim_fleet daemon: {e}");
                std::process::exit(1);
            }
        }
        _ => usage(),
    }
}

fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("runtime")
}

fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LBSCALE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
}

fn group_id(i: usize) -> String {
    format!("ag-bench-{i:05}")
}

/// The index of a group made by `setup`, from its id.
fn group_index(id: &str) -> Option<usize> {
    id.strip_prefix("ag-bench-")?.parse().ok()
}

/// The address of node `k` (from 0) of all the nodes `setup` makes.
fn setup_address(k: usize) -> String {
    let k = k + 1; // no .0.0
    format!("127.100.{}.{}", (k >> 8) & 0xff, k & 0xff)
}

fn setup(url: &str, base: &std::path::Path, n: usize, port: u16, interval: &str) {
    assert!(
        n * AZS.len() * NODES_PER_AZ < 65_000,
        "at most 10,800 groups: their nodes' addresses are one /16"
    );
    let store = Store::open_url(url, base).expect("open the store");
    let started = std::time::Instant::now();
    let mut k = 0;
    for i in 0..n {
        let id = group_id(i);
        if store.group(&id).expect("read a group").is_some() {
            k += AZS.len() * NODES_PER_AZ;
            continue; // made by an earlier run
        }
        let distributor = format!("td-bench-{i:05}");
        store
            .insert_distributor(
                &distributor,
                &DistributorSpec {
                    name: format!("bench-{i:05}"),
                    cloud: CloudName::Local,
                    mode: DistributorMode::Dns,
                    domain: Some(format!("g{i:05}.bench.lbscale.test")),
                    ttl: DeclaredDuration::parse("1s").unwrap(),
                },
            )
            .expect("insert a distributor");
        let spec = GroupSpec {
            name: format!("g{i:05}"),
            cloud: CloudName::Local,
            availability_zones: AZS.iter().map(|a| a.to_string()).collect(),
            traffic_distributor_id: distributor,
            min_nodes: NODES_PER_AZ as i64,
            max_nodes: NODES_PER_AZ as i64 + 1,
            stats_interval: DeclaredDuration::parse(interval).unwrap(),
            watch_time: DeclaredDuration::parse(interval).unwrap(),
            cooldown: DeclaredDuration::parse("3s").unwrap(),
            drain_timeout: DeclaredDuration::parse("2s").unwrap(),
            thresholds: vec![ThresholdSpec {
                metric: Metric::Cpu,
                min: 10.0,
                max: 90.0,
            }],
            node: None,
            apply_timeout: DeclaredDuration::parse("120s").unwrap(),
        };
        let secret: String = (0..32)
            .map(|_| format!("{:02x}", rand::random::<u8>()))
            .collect();
        store
            .insert_group(&id, &spec, &secret)
            .expect("insert a group");
        let mut seq = 0;
        for az in AZS {
            for _ in 0..NODES_PER_AZ {
                seq += 1;
                store
                    .insert_node(&NodeRow {
                        id: format!("{}-{az}-{seq}-sim", spec.name),
                        group_id: id.clone(),
                        az: az.to_string(),
                        seq,
                        state: NodeState::Active,
                        private_ip: setup_address(k),
                        public_ip: None,
                        registered: true,
                        handle: serde_json::json!({ "api_port": port }),
                        created_at: now_ms(),
                    })
                    .expect("insert a node");
                k += 1;
            }
        }
        if (i + 1) % 1000 == 0 {
            eprintln!("{} groups in {:?}", i + 1, started.elapsed());
        }
    }
    println!(
        "{n} groups ({} nodes) in the store in {:?}",
        k,
        started.elapsed()
    );
}

// --- the nodes --------------------------------------------------------------------

/// One simulated node.
#[derive(Clone)]
struct SimNode {
    id: String,
    /// `Bearer TOKEN`, as its calls must carry it.
    bearer: Arc<Vec<u8>>,
    hot: bool,
    /// Its TLS configuration (made at its first connection).
    tls: Arc<Mutex<Option<Arc<rustls::ServerConfig>>>>,
    ca: Arc<GroupCa>,
}

#[derive(Default)]
struct Fleet {
    by_ip: HashMap<Ipv4Addr, SimNode>,
}

/// Reads the store's nodes into `fleet` (new ones added, gone ones dropped);
/// the CA of each group derived once.
fn load(store: &Store, fleet: &RwLock<Fleet>, cas: &mut HashMap<String, Arc<GroupCa>>, hot: usize) {
    let rows = match store.node_addresses() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sim_fleet nodes: cannot read the nodes: {e}");
            return;
        }
    };
    let old = fleet.read().unwrap();
    let mut by_ip = HashMap::with_capacity(rows.len());
    for (id, group, ip) in rows {
        let Ok(ip) = ip.parse::<Ipv4Addr>() else {
            continue;
        };
        if let Some(n) = old.by_ip.get(&ip).filter(|n| n.id == id) {
            by_ip.insert(ip, n.clone());
            continue;
        }
        let Ok(Some(secret)) = store.group_token(&group) else {
            continue;
        };
        let ca = match cas.get(&group) {
            Some(ca) => ca.clone(),
            None => {
                let ca = Arc::new(GroupCa::derive(&secret).expect("derive the group CA"));
                cas.insert(group.clone(), ca.clone());
                ca
            }
        };
        let node = SimNode {
            bearer: Arc::new(bearer(&secret, &id).into_bytes()),
            hot: group_index(&group).is_some_and(|i| i < hot),
            tls: Arc::default(),
            ca,
            id,
        };
        by_ip.insert(ip, node);
    }
    drop(old);
    fleet.write().unwrap().by_ip = by_ip;
}

/// The node's server configuration: its certificate from the group's CA, the
/// engine's client certificate required.
fn server_config(node: &SimNode) -> Arc<rustls::ServerConfig> {
    let mut cached = node.tls.lock().unwrap();
    if let Some(c) = cached.as_ref() {
        return c.clone();
    }
    let (cert, key) = node
        .ca
        .issue_node(&node.id)
        .expect("issue the node's certificate");
    let config =
        node_server_config(&node.ca.cert_pem(), &cert, &key).expect("the node's TLS configuration");
    let config = Arc::new(config);
    *cached = Some(config.clone());
    config
}

struct SimApi {
    fleet: Arc<RwLock<Fleet>>,
}

impl SimApi {
    /// The node the call was made to, if the call carries its token.
    #[allow(clippy::result_large_err)] // tonic's Status is what a handler returns
    fn node<T>(&self, req: &Request<T>) -> Result<SimNode, Status> {
        let Some(SocketAddr::V4(local)) = req.local_addr() else {
            return Err(Status::permission_denied("not a simulated node's address"));
        };
        let node = self
            .fleet
            .read()
            .unwrap()
            .by_ip
            .get(local.ip())
            .cloned()
            .ok_or_else(|| Status::permission_denied("no node at this address"))?;
        let ok = req
            .metadata()
            .get(AUTH_HEADER)
            .is_some_and(|v| v.as_bytes() == node.bearer.as_slice());
        if !ok {
            return Err(Status::unauthenticated("missing or invalid bearer token"));
        }
        Ok(node)
    }
}

#[tonic::async_trait]
impl NodeApi for SimApi {
    async fn configure(
        &self,
        req: Request<NodeConfig>,
    ) -> Result<Response<ConfigureReply>, Status> {
        self.node(&req)?;
        Ok(Response::new(ConfigureReply {
            applied_version: req.into_inner().version,
        }))
    }

    async fn drain(&self, req: Request<DrainRequest>) -> Result<Response<DrainReply>, Status> {
        self.node(&req)?;
        Ok(Response::new(DrainReply {
            active_connections: 0,
        }))
    }

    async fn get_stats(&self, req: Request<StatsRequest>) -> Result<Response<NodeStats>, Status> {
        let node = self.node(&req)?;
        Ok(Response::new(stats_of(&node, req.into_inner().window_ms)))
    }
}

/// What a simulated node reports: hot or not, nothing else changes.
fn stats_of(node: &SimNode, window_ms: u64) -> NodeStats {
    NodeStats {
        node_id: node.id.clone(),
        state: "active".into(),
        cpu_percent: if node.hot { 95.0 } else { 50.0 },
        memory_percent: 30.0,
        throughput_mbps: 1.0,
        window_ms,
        stats_source: "instance".into(),
        uptime_ms: 3_600_000,
        ..Default::default()
    }
}

/// The statistics call over HTTP/1.1 for `node`, as a real node serves it.
async fn serve_stats(node: SimNode, tls: TlsConn) {
    let _ = stats_http::serve(tls, Duration::from_secs(15 * 60), |asked| {
        let node = &node;
        async move {
            if asked.authorization.as_deref() != Some(node.bearer.as_slice()) {
                return stats_http::Reply::Refused(401, "missing or invalid bearer token".into());
            }
            stats_http::Reply::Stats(stats_of(node, asked.window.as_millis() as u64))
        }
    })
    .await;
}

type TlsConn = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

async fn nodes(url: &str, base: PathBuf, port: u16, hot: usize) {
    let store = Arc::new(Store::open_url(url, &base).expect("open the store"));
    let fleet = Arc::new(RwLock::new(Fleet::default()));
    {
        let (store, fleet) = (store.clone(), fleet.clone());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut cas = HashMap::new();
            loop {
                load(&store, &fleet, &mut cas, hot);
                let _ = ready_tx.send(());
                std::thread::sleep(Duration::from_secs(3));
            }
        });
        ready_rx.recv().expect("the first load");
    }
    let count = fleet.read().unwrap().by_ip.len();
    let listener =
        tokio::net::TcpListener::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port))
            .await
            .unwrap_or_else(|e| panic!("listen on 0.0.0.0:{port}: {e}"));
    println!("serving {count} simulated nodes on port {port} ({hot} hot groups)");
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<TlsConn>>(1024);
    let accept_fleet = fleet.clone();
    tokio::spawn(async move {
        loop {
            let (s, _) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("sim_fleet nodes: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = s.set_nodelay(true);
            let (fleet, tx) = (accept_fleet.clone(), tx.clone());
            tokio::spawn(async move {
                let Ok(SocketAddr::V4(local)) = s.local_addr() else {
                    return;
                };
                if !local.ip().is_loopback() {
                    return;
                }
                let Some(node) = fleet.read().unwrap().by_ip.get(local.ip()).cloned() else {
                    return; // not (yet) a node: the client retries at its next sample
                };
                let acceptor =
                    tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), s);
                let Ok(Ok(start)) = tokio::time::timeout(Duration::from_secs(10), acceptor).await
                else {
                    return;
                };
                // The client dials this node by its name: another node's
                // certificate must not be what it gets.
                if start.client_hello().server_name() != Some(node_name(&node.id).as_str()) {
                    return;
                }
                let config = server_config(&node);
                if let Ok(Ok(tls)) =
                    tokio::time::timeout(Duration::from_secs(10), start.into_stream(config)).await
                {
                    if tls.get_ref().1.alpn_protocol() == Some(stats_http::ALPN) {
                        serve_stats(node, tls).await;
                    } else {
                        let _ = tx.send(Ok(tls)).await;
                    }
                }
            });
        }
    });
    let api = SimApi { fleet };
    tonic::transport::Server::builder()
        .add_service(NodeApiServer::new(api))
        .serve_with_incoming(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("serve the nodes");
}

// --- the cloud of simulated nodes ---------------------------------------------

struct SimCloud {
    store: DriverStore,
    port: u16,
}

#[async_trait::async_trait]
impl lbscale_engine::cloud::Cloud for SimCloud {
    async fn provision(&self, req: &ProvisionRequest) -> Result<Provisioned, CloudError> {
        // From a random place in the range: three daemons provision at once.
        let start = rand::random::<u16>() as usize;
        let candidates = (0..65_000usize).map(move |i| {
            let k = (start + i) % 65_000 + 1;
            format!("127.101.{}.{}", (k >> 8) & 0xff, k & 0xff)
        });
        let ip = self
            .store
            .reserve_address(&req.node_id, candidates, |_| true)?
            .ok_or_else(|| CloudError::Failed("no address left in 127.101.0.0/16".into()))?;
        Ok(Provisioned {
            private_ip: ip,
            public_ip: None,
            api_port: self.port,
            handle: serde_json::json!({ "api_port": self.port }),
        })
    }
    async fn deprovision(&self, node: &NodeRow) -> Result<(), CloudError> {
        self.store.release_addresses(&node.id)
    }
    async fn is_alive(&self, _node: &NodeRow) -> Result<bool, CloudError> {
        Ok(true)
    }
    async fn alive(&self, nodes: &[NodeRow]) -> Result<Vec<bool>, CloudError> {
        Ok(vec![true; nodes.len()])
    }
    fn api_port(&self, node: &NodeRow) -> u16 {
        node.handle
            .get("api_port")
            .and_then(|p| p.as_u64())
            .map_or(self.port, |p| p as u16)
    }
}

#[async_trait::async_trait]
impl Distributor for SimCloud {
    async fn ensure(&self, _id: &str, _spec: &DistributorSpec) -> Result<(), CloudError> {
        Ok(())
    }
    async fn publish(
        &self,
        _id: &str,
        _spec: &DistributorSpec,
        _publication: &Publication,
    ) -> Result<(), CloudError> {
        Ok(())
    }
    async fn remove(&self, _id: &str) -> Result<(), CloudError> {
        Ok(())
    }
    fn addresses(&self, _id: &str, _spec: &DistributorSpec) -> BTreeMap<String, String> {
        BTreeMap::new()
    }
}

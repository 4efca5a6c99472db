//! What this host has: providers, RDMA devices and their ports and GIDs, the memlock limit,
//! soft-RoCE, PFC/ECN, read from sysfs and procfs (no device is opened but to ask its caps).

use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rdma_rpc::transport::{Device, Error};

use crate::Finding;

const SYSFS_IB: &str = "/sys/class/infiniband";

/// Every check that needs no peer; `ip`: say which GID it maps to.
pub(crate) fn check(ip: Option<IpAddr>) -> Vec<Finding> {
    let mut out = providers();
    let devices = devices();
    if devices.is_empty() {
        out.push(no_device());
    }
    for d in &devices {
        out.extend(describe(d));
    }
    out.push(memlock(!devices.is_empty()));
    if let Some(ip) = ip {
        out.push(gid_of(&devices, ip));
    }
    out
}

/// `verbs` when a device is there and usable, else `tcp`.
pub(crate) fn default_provider(findings: &[Finding]) -> String {
    if let Ok(p) = std::env::var(rdma_rpc::transport::PROVIDER_ENV) {
        return p;
    }
    let verbs = findings.iter().any(|f| f.what.starts_with("provider verbs: device"));
    if verbs { "verbs" } else { "tcp" }.to_string()
}

fn providers() -> Vec<Finding> {
    let mut out = Vec::new();
    for p in ["tcp", "shm"] {
        out.push(match Device::open(p) {
            Ok(_) => Finding::ok(format!("provider {p}: available")),
            Err(e) => Finding::fail(
                format!("provider {p}: {e}"),
                "report this: the software providers need only Linux",
            ),
        });
    }
    out.push(match Device::open("verbs") {
        Ok(d) => Finding::ok(format!("provider verbs: device {} opened", d.name())),
        Err(Error::ProviderNotBuilt(_)) => Finding::warn(
            "provider verbs: not compiled in",
            "build with the default features (the `verbs` feature) and rdma-core's libraries installed",
        ),
        Err(e) => Finding::warn(
            format!("provider verbs: {}", rdma_rpc::transport::Report(&e)),
            "see the device lines below; tcp and shm work without a device",
        ),
    });
    out
}

/// An RDMA device as sysfs shows it.
struct Dev {
    name: String,
    path: PathBuf,
    ports: Vec<Port>,
}

struct Port {
    num: String,
    state: String,
    link_layer: String,
    /// (index, GID, type, netdev)
    gids: Vec<(usize, String, String, String)>,
}

fn read(p: impl AsRef<Path>) -> String {
    fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default()
}

fn entries(p: impl AsRef<Path>) -> Vec<(String, PathBuf)> {
    let mut v: Vec<(String, PathBuf)> = fs::read_dir(p)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn devices() -> Vec<Dev> {
    entries(SYSFS_IB)
        .into_iter()
        .map(|(name, path)| {
            let ports = entries(path.join("ports"))
                .into_iter()
                .map(|(num, p)| {
                    let mut gids = Vec::new();
                    for (i, g) in entries(p.join("gids")) {
                        let gid = read(&g);
                        if gid.is_empty() || gid.chars().all(|c| c == '0' || c == ':') {
                            continue;
                        }
                        let Ok(idx) = i.parse::<usize>() else { continue };
                        let ty = read(p.join("gid_attrs/types").join(&i));
                        let nd = read(p.join("gid_attrs/ndevs").join(&i));
                        gids.push((idx, gid, ty, nd));
                    }
                    gids.sort();
                    Port {
                        num,
                        state: read(p.join("state")),
                        link_layer: read(p.join("link_layer")),
                        gids,
                    }
                })
                .collect();
            Dev { name, path, ports }
        })
        .collect()
}

/// The interface of the default route (`/proc/net/route`), to name in advice.
fn default_iface() -> String {
    read("/proc/net/route")
        .lines()
        .skip(1)
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&"00000000")).then(|| f[0].to_string())
        })
        .unwrap_or_else(|| "<your interface>".into())
}

fn no_device() -> Finding {
    let iface = default_iface();
    let release = read("/proc/sys/kernel/osrelease");
    let loaded = Path::new("/sys/module/rdma_rxe").exists();
    let available = read(format!("/lib/modules/{release}/modules.dep")).contains("rdma_rxe.ko");
    let todo = if loaded {
        format!("rdma_rxe is loaded: add a soft-RoCE device with `rdma link add rxe0 type rxe netdev {iface}`; or use provider tcp (any hosts) or shm (one host)")
    } else if available {
        format!("no RDMA card: load soft-RoCE with `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev {iface}`; or use provider tcp (any hosts) or shm (one host)")
    } else {
        "no RDMA card, and this kernel has no rdma_rxe module (soft-RoCE): use provider tcp (any hosts) or shm (one host), or run in a VM whose kernel has it (scripts/rxe-vm.sh)".to_string()
    };
    Finding::warn(format!("no RDMA device in {SYSFS_IB}"), todo)
}

fn describe(d: &Dev) -> Vec<Finding> {
    let mut out = Vec::new();
    // A software device (rxe, siw) has no PCI device under it.
    let soft = !d.path.join("device").exists();
    let atomics = Device::open(&format!("verbs:{}", d.name)).map(|dev| dev.caps().atomics);
    let kind = if soft {
        "software (soft-RoCE or siw)"
    } else {
        "hardware"
    };
    match &atomics {
        Ok(a) => out.push(Finding::ok(format!(
            "device {}: {kind}, opened, atomics {}",
            d.name,
            if *a { "yes" } else { "no" }
        ))),
        Err(e) => out.push(Finding::fail(
            format!(
                "device {}: {kind}, cannot be opened: {}",
                d.name,
                rdma_rpc::transport::Report(e)
            ),
            "check the rdma-core libraries (libibverbs, librdmacm) and the permissions of /dev/infiniband",
        )),
    }
    for p in &d.ports {
        let active = p.state.contains("ACTIVE");
        let mtu = p
            .gids
            .first()
            .map(|g| read(format!("/sys/class/net/{}/mtu", g.3)))
            .unwrap_or_default();
        let what = format!(
            "device {} port {}: {}, link layer {}, {}",
            d.name,
            p.num,
            p.state,
            p.link_layer,
            match mtu.parse::<u32>() {
                Ok(m) => format!("active MTU {} (netdev MTU {m})", roce_mtu(m)),
                Err(_) => "MTU unknown".into(),
            }
        );
        out.push(if active {
            Finding::ok(what)
        } else {
            Finding::fail(
                what,
                format!(
                    "bring the link up (`ip link set <netdev> up`; `rdma link show {}`)",
                    d.name
                ),
            )
        });
        if p.gids.is_empty() {
            out.push(Finding::fail(
                format!("device {} port {}: no GID", d.name, p.num),
                "give the netdev an IP address: RoCE GIDs come from its addresses",
            ));
        }
        for (i, gid, ty, nd) in &p.gids {
            out.push(Finding::ok(format!(
                "device {} port {} GID {i}: {gid} ({}{})",
                d.name,
                p.num,
                if ty.is_empty() { "IB" } else { ty },
                if nd.is_empty() {
                    String::new()
                } else {
                    format!(" on {nd}")
                }
            )));
        }
        if p.link_layer == "Ethernet" {
            out.push(fabric(soft, p.gids.first().map(|g| g.3.as_str()).unwrap_or("")));
        }
    }
    out
}

/// The RoCE path MTU a netdev MTU gives: the largest IB MTU that fits beside the RoCE
/// headers (1500 gives 1024, 9000 gives 4096), as `ibv_devinfo` reports it.
fn roce_mtu(netdev: u32) -> u32 {
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|&m| m + 100 <= netdev)
        .unwrap_or(256)
}

/// What can be said of PFC and ECN on a RoCE port's netdev.
fn fabric(soft: bool, netdev: &str) -> Finding {
    if soft {
        return Finding::ok(format!(
            "RoCE on {netdev} is soft-RoCE: no PFC/ECN to set; loss costs retransmits (RDMA's go-back-N), so keep the link uncongested"
        ));
    }
    let ecn = Path::new("/sys/class/net").join(netdev).join("ecn/roce_np/enable");
    let pfc = Path::new("/sys/class/net").join(netdev).join("qos/pfc");
    match (fs::read_dir(&ecn).is_ok(), fs::read_to_string(&pfc)) {
        (true, Ok(p)) => Finding::ok(format!("{netdev}: ECN settings readable ({}), PFC {}", ecn.display(), p.trim())),
        _ => Finding::warn(
            format!("{netdev}: PFC/ECN settings not readable from sysfs"),
            format!("check them with your NIC's tools (`mlnx_qos -i {netdev}`, `dcb pfc show dev {netdev}`): a lossy RoCE fabric shows as retry-exceeded errors and jitter"),
        ),
    }
}

/// Bytes a default connection registers on each side: its receive ring and send buffers.
fn default_connection_bytes() -> u64 {
    let c = rdma_rpc::Config::default();
    let slot = rdma_rpc::core::proto::SessionConfig {
        ring: c.ring,
        eager_max: rdma_rpc::DEFAULT_EAGER_THRESHOLD,
        fragment: rdma_rpc::core::proto::FRAGMENT,
        max_payload: c.max_payload,
    }
    .slot_size() as u64;
    (2 * u64::from(c.ring) + 8) * slot
}

fn memlock(device: bool) -> Finding {
    let line = read("/proc/self/limits")
        .lines()
        .find(|l| l.starts_with("Max locked memory"))
        .map(str::to_string)
        .unwrap_or_default();
    let soft = line.split_whitespace().nth(3).unwrap_or("?").to_string();
    let per = default_connection_bytes();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    if soft == "unlimited" {
        return Finding::ok("memlock limit: unlimited");
    }
    let Ok(limit) = soft.parse::<u64>() else {
        return Finding::warn("memlock limit: unreadable (/proc/self/limits)", "check `ulimit -l`");
    };
    let fits = limit / per.max(1);
    let what = format!(
        "memlock limit {:.1} MiB: a default connection registers {:.2} MiB on each side (plus up to {} MiB of cached rendezvous buffers), so about {fits} fit",
        mib(limit),
        mib(per),
        rdma_rpc::Config::default().max_cached_buffer_bytes >> 20
    );
    let todo = "raise it for verbs (`ulimit -l unlimited`, or memlock in /etc/security/limits.conf, or LimitMEMLOCK= for a systemd service); tcp and shm do not pin memory";
    if !device {
        Finding::ok(format!("{what} (matters on verbs only)"))
    } else if fits < 16 {
        Finding::fail(what, todo)
    } else {
        Finding::ok(what)
    }
}

/// Which device, port and GID index `ip` maps to (RoCE v2 carries IPv4 as `::ffff:a.b.c.d`).
fn gid_of(devices: &[Dev], ip: IpAddr) -> Finding {
    let want = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    for d in devices {
        for p in &d.ports {
            for (i, gid, ty, nd) in &p.gids {
                if gid.parse::<std::net::Ipv6Addr>().is_ok_and(|g| g == want) {
                    return Finding::ok(format!(
                        "{ip} is GID {i} of {} port {} ({ty} on {nd}): rdma_cm resolves it there",
                        d.name, p.num
                    ));
                }
            }
        }
    }
    Finding::fail(
        format!("{ip} is no GID of any RDMA port"),
        "give the address to an RDMA device's netdev (for soft-RoCE, the netdev given to `rdma link add`), or connect to an address that is one",
    )
}

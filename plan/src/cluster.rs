//! The machines a run is planned for: how many accelerators, how they are
//! grouped into nodes, what each computes and holds, and what the links
//! between them carry — from a preset, a TOML file, or (in the trainer's
//! `weft plan --calibrate`) measured on this machine.
//!
//! A cluster file (every key optional when `base` names a preset):
//!
//! ```toml
//! name = "my-cluster"
//! base = "h100"                # start from a preset, override below
//! gpus = 256
//! gpus_per_node = 8
//! memory_gib = 80              # per GPU
//! memory_bandwidth_gbs = 3350  # per GPU, GB/s
//! launch_overhead_us = 4       # fixed cost of each kernel launch
//! network_cpu_ns_per_byte = 0  # CPU nodes of one machine: the cores' time per byte between nodes
//! [peak_tflops]                # dense, per GPU
//! fp32 = 67
//! bf16 = 989
//! fp16 = 989
//! [intra_node]                 # per GPU, each direction
//! bandwidth_gbs = 450
//! latency_us = 5
//! [inter_node]
//! bandwidth_gbs = 50
//! latency_us = 10
//! [efficiency]                 # fractions of the peaks reached
//! gemm = 0.75
//! memory = 0.7
//! link = 0.8
//! ```

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Origin, Result};

/// The arithmetic of the matrix products: the kernels' own choice.
pub use weft_kernels::Precision;

/// Dense peak arithmetic per GPU, FLOP/s.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Peak {
    /// f32 products.
    pub fp32: f64,
    /// bf16 products.
    pub bf16: f64,
    /// fp16 products.
    pub fp16: f64,
}

impl Peak {
    /// The peak of `p`.
    #[must_use]
    pub fn of(&self, p: Precision) -> f64 {
        match p {
            Precision::F32 => self.fp32,
            Precision::Bf16 => self.bf16,
            Precision::F16 => self.fp16,
        }
    }
}

/// One kind of link, per GPU and direction: the α–β model's `α` (latency
/// of a message) and `1/β` (bandwidth).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bytes per second one GPU can send (and receive) at once.
    pub bandwidth: f64,
    /// Seconds of a message's fixed cost.
    pub latency: f64,
}

/// Fractions of the peaks that real work reaches (the same for every
/// layout planned on the cluster).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Efficiency {
    /// Of the peak FLOP/s, in large matrix products.
    pub gemm: f64,
    /// Of the memory bandwidth, in element-wise work (layernorms,
    /// activations, softmax, the optimizer).
    pub memory: f64,
    /// Of each link's bandwidth, in collectives.
    pub link: f64,
}

impl Efficiency {
    /// The GPU presets' fractions: 75% of peak in large GEMMs (cuBLAS's
    /// large half-precision GEMMs on A100 and H100), 70% of HBM bandwidth
    /// in element-wise kernels, 80% of a link's bandwidth in NCCL's
    /// collectives (nccl-tests' bus bandwidth on DGX systems).
    pub const GPU: Efficiency = Efficiency {
        gemm: 0.75,
        memory: 0.7,
        link: 0.8,
    };
}

/// What runs on each device: GPUs, or CPU ranks (weft's threads, which
/// share the cores with their collectives).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// Accelerators: collectives run on their own engines and may overlap
    /// with compute.
    #[default]
    Gpu,
    /// CPU ranks of one machine: a collective takes the cores that compute,
    /// so nothing overlaps.
    Cpu,
    /// CPU ranks on nodes of their own network whose cores are one
    /// machine's (`scripts/cluster.sh`'s namespaces, MPI processes): the
    /// machine's rates are shared out over every rank as for [`Cpu`](Self::Cpu),
    /// and a collective inside a node takes the cores; one that spans
    /// nodes waits on the link, which the cores do not, so it overlaps
    /// with compute as on GPUs. It runs as one ring over the group (weft's
    /// exact sums and the MPI library's all-gather): each ring step crosses
    /// a node's link once per direction, at the whole link's rate
    /// (`inter` times the ranks per node).
    CpuNodes,
}

impl Device {
    /// Whether the ranks share one machine's cores and memory (the
    /// cluster's rates and memory are the machine's, shared out).
    #[must_use]
    pub fn shares_machine(self) -> bool {
        matches!(self, Device::Cpu | Device::CpuNodes)
    }
}

/// A cluster: its accelerators, their memory and arithmetic, and the links.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// A name for reports.
    pub name: String,
    /// GPUs (or ranks) in the cluster.
    pub gpus: usize,
    /// GPUs per node (the domain of the fast links).
    pub gpus_per_node: usize,
    /// Bytes of memory per GPU.
    pub memory: f64,
    /// Bytes per second of memory bandwidth per GPU.
    pub memory_bandwidth: f64,
    /// Seconds of fixed cost per kernel (launch, or a CPU thread pool's
    /// dispatch).
    pub launch_overhead: f64,
    /// Dense peak arithmetic per GPU.
    pub peak: Peak,
    /// Links inside a node (NVLink; shared memory for CPU ranks).
    pub intra: Link,
    /// Links between nodes (InfiniBand, per GPU).
    pub inter: Link,
    /// Fractions of the peaks reached.
    pub efficiency: Efficiency,
    /// GPUs, or CPU ranks.
    pub device: Device,
    /// Seconds of the whole machine's cores each byte sent between nodes
    /// takes ([`Device::CpuNodes`]: the nodes' network is software on the
    /// cores that compute, the kernel's TCP over virtual links, and the
    /// MPI library's copies and polls); 0 where a NIC moves the bytes.
    #[serde(default)]
    pub network_cpu: f64,
}

const GB: f64 = 1e9;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const TFLOPS: f64 = 1e12;
const US: f64 = 1e-6;

/// The presets' names.
pub const PRESETS: [&str; 4] = ["a100-80gb", "a100-40gb", "h100", "h200"];

impl Cluster {
    /// A preset cluster of DGX-style nodes of 8 GPUs, with `gpus` GPUs:
    ///
    /// * `a100-80gb`, `a100-40gb`: NVIDIA A100 SXM (312 TFLOP/s bf16/fp16
    ///   dense, 19.5 fp32; 80 GiB HBM2e at 2039 GB/s, or 40 GiB at 1555
    ///   GB/s), NVLink 3 (600 GB/s per GPU both ways: 300 each), one
    ///   200 Gb/s HDR InfiniBand port per GPU (25 GB/s) — DGX A100, e.g.
    ///   NVIDIA's Selene.
    /// * `h100`: H100 SXM5 (989 TFLOP/s bf16/fp16 dense, 67 fp32; 80 GiB
    ///   HBM3 at 3350 GB/s), NVLink 4 (450 GB/s each way), one 400 Gb/s
    ///   NDR port per GPU (50 GB/s) — DGX H100.
    /// * `h200`: as `h100` with 141 GB of HBM3e at 4800 GB/s.
    ///
    /// Latencies: 5 µs per message inside a node, 10 µs between nodes;
    /// 4 µs per kernel launch; [`Efficiency::GPU`].
    ///
    /// # Errors
    /// [`Error::UnknownPreset`] listing the presets.
    pub fn preset(name: &str, gpus: usize) -> Result<Self> {
        let gpu = |name: &str, mem: f64, bw: f64, peak: Peak, nvlink: f64, ib: f64| Cluster {
            name: name.to_owned(),
            gpus,
            gpus_per_node: 8,
            memory: mem,
            memory_bandwidth: bw,
            launch_overhead: 4.0 * US,
            peak,
            intra: Link {
                bandwidth: nvlink,
                latency: 5.0 * US,
            },
            inter: Link {
                bandwidth: ib,
                latency: 10.0 * US,
            },
            efficiency: Efficiency::GPU,
            device: Device::Gpu,
            network_cpu: 0.0,
        };
        let a100 = Peak {
            fp32: 19.5 * TFLOPS,
            bf16: 312.0 * TFLOPS,
            fp16: 312.0 * TFLOPS,
        };
        let h100 = Peak {
            fp32: 67.0 * TFLOPS,
            bf16: 989.0 * TFLOPS,
            fp16: 989.0 * TFLOPS,
        };
        match name.to_ascii_lowercase().as_str() {
            "a100-80gb" | "a100" => Ok(gpu(
                "a100-80gb",
                80.0 * GIB,
                2039.0 * GB,
                a100,
                300.0 * GB,
                25.0 * GB,
            )),
            "a100-40gb" => Ok(gpu(
                "a100-40gb",
                40.0 * GIB,
                1555.0 * GB,
                a100,
                300.0 * GB,
                25.0 * GB,
            )),
            "h100" => Ok(gpu(
                "h100",
                80.0 * GIB,
                3350.0 * GB,
                h100,
                450.0 * GB,
                50.0 * GB,
            )),
            "h200" => Ok(gpu(
                "h200",
                141.0 * GB,
                4800.0 * GB,
                h100,
                450.0 * GB,
                50.0 * GB,
            )),
            _ => Err(Error::UnknownPreset {
                name: name.to_owned(),
                known: PRESETS.join(", "),
            }),
        }
    }

    /// Nodes (the last one possibly partly filled).
    #[must_use]
    pub fn nodes(&self) -> usize {
        self.gpus.div_ceil(self.gpus_per_node.max(1))
    }

    /// The same cluster with `gpus` GPUs.
    #[must_use]
    pub fn with_gpus(mut self, gpus: usize) -> Self {
        self.gpus = gpus;
        self
    }

    /// Checks every figure.
    ///
    /// # Errors
    /// [`Error::Cluster`] naming the first key out of range.
    pub fn validate(&self) -> Result<()> {
        self.validate_from(&Origin {
            source: format!("cluster {}", self.name),
            position: None,
        })
    }

    fn validate_from(&self, origin: &Origin) -> Result<()> {
        let bad = |key: &str, message: String| {
            Err(Error::Cluster {
                origin: origin.clone(),
                key: Some(key.to_owned()),
                message,
            })
        };
        if self.gpus == 0 {
            return bad("gpus", "must be at least 1".into());
        }
        if self.gpus_per_node == 0 {
            return bad("gpus_per_node", "must be at least 1".into());
        }
        let positive = [
            ("memory_gib", self.memory),
            ("memory_bandwidth_gbs", self.memory_bandwidth),
            ("peak_tflops.fp32", self.peak.fp32),
            ("peak_tflops.bf16", self.peak.bf16),
            ("peak_tflops.fp16", self.peak.fp16),
            ("intra_node.bandwidth_gbs", self.intra.bandwidth),
            ("inter_node.bandwidth_gbs", self.inter.bandwidth),
        ];
        for (key, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return bad(key, format!("must be a finite number > 0 (got {v})"));
            }
        }
        for (key, v) in [
            ("launch_overhead_us", self.launch_overhead),
            ("network_cpu_ns_per_byte", self.network_cpu),
            ("intra_node.latency_us", self.intra.latency),
            ("inter_node.latency_us", self.inter.latency),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(key, format!("must be a finite number >= 0 (got {v})"));
            }
        }
        for (key, v) in [
            ("efficiency.gemm", self.efficiency.gemm),
            ("efficiency.memory", self.efficiency.memory),
            ("efficiency.link", self.efficiency.link),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return bad(key, format!("must be in (0, 1] (got {v})"));
            }
        }
        Ok(())
    }

    /// Reads a cluster file (see the [module docs](self)).
    ///
    /// # Errors
    /// [`Error::Cluster`] naming the file, line, column and key of the
    /// problem: unreadable, not TOML, an unknown key, a value of the wrong
    /// type, a missing key (without `base`), a value out of range.
    pub fn from_file(path: &Path) -> Result<Self> {
        let source = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| Error::Cluster {
            origin: Origin {
                source: source.clone(),
                position: None,
            },
            key: None,
            message: format!("cannot read: {e}"),
        })?;
        Self::from_toml(&text, &source)
    }

    /// Parses a cluster description; `source` names it in errors.
    ///
    /// # Errors
    /// As [`from_file`](Self::from_file).
    pub fn from_toml(text: &str, source: &str) -> Result<Self> {
        let at = |position: Option<(usize, usize)>| Origin {
            source: source.to_owned(),
            position,
        };
        let file: ClusterFile = toml::from_str(text).map_err(|e| {
            let position = e.span().map(|s| line_col(text, s.start));
            Error::Cluster {
                origin: at(position),
                key: position.and_then(|(line, _)| key_at_line(text, line)),
                message: e.message().trim().to_owned(),
            }
        })?;
        // where each key is, for range errors
        let position_of = |key: &str| find_key(text, key);
        let base =
            match &file.base {
                Some(b) => Some(Cluster::preset(b, file.gpus.unwrap_or(8)).map_err(|e| {
                    Error::Cluster {
                        origin: at(position_of("base")),
                        key: Some("base".into()),
                        message: e.to_string(),
                    }
                })?),
                None => None,
            };
        let missing = |key: &str| Error::Cluster {
            origin: at(None),
            key: Some(key.to_owned()),
            message: "missing (give it, or `base = \"PRESET\"` to start from a preset)".into(),
        };
        let pick = |v: Option<f64>, scale: f64, key: &str, from_base: Option<f64>| {
            v.map(|x| x * scale)
                .or(from_base)
                .ok_or_else(|| missing(key))
        };
        let b = base.as_ref();
        let peak = file.peak_tflops.unwrap_or_default();
        let intra = file.intra_node.unwrap_or_default();
        let inter = file.inter_node.unwrap_or_default();
        let eff = file.efficiency.unwrap_or_default();
        let cluster = Cluster {
            name: file
                .name
                .or_else(|| b.map(|c| c.name.clone()))
                .unwrap_or_else(|| source.to_owned()),
            gpus: file
                .gpus
                .or(b.map(|c| c.gpus))
                .ok_or_else(|| missing("gpus"))?,
            gpus_per_node: file
                .gpus_per_node
                .or(b.map(|c| c.gpus_per_node))
                .ok_or_else(|| missing("gpus_per_node"))?,
            memory: pick(file.memory_gib, GIB, "memory_gib", b.map(|c| c.memory))?,
            memory_bandwidth: pick(
                file.memory_bandwidth_gbs,
                GB,
                "memory_bandwidth_gbs",
                b.map(|c| c.memory_bandwidth),
            )?,
            launch_overhead: pick(
                file.launch_overhead_us,
                US,
                "launch_overhead_us",
                b.map(|c| c.launch_overhead).or(Some(0.0)),
            )?,
            peak: Peak {
                fp32: pick(
                    peak.fp32,
                    TFLOPS,
                    "peak_tflops.fp32",
                    b.map(|c| c.peak.fp32),
                )?,
                bf16: pick(
                    peak.bf16,
                    TFLOPS,
                    "peak_tflops.bf16",
                    b.map(|c| c.peak.bf16),
                )?,
                fp16: pick(
                    peak.fp16,
                    TFLOPS,
                    "peak_tflops.fp16",
                    b.map(|c| c.peak.fp16),
                )?,
            },
            intra: Link {
                bandwidth: pick(
                    intra.bandwidth_gbs,
                    GB,
                    "intra_node.bandwidth_gbs",
                    b.map(|c| c.intra.bandwidth),
                )?,
                latency: pick(
                    intra.latency_us,
                    US,
                    "intra_node.latency_us",
                    b.map(|c| c.intra.latency),
                )?,
            },
            inter: Link {
                bandwidth: pick(
                    inter.bandwidth_gbs,
                    GB,
                    "inter_node.bandwidth_gbs",
                    b.map(|c| c.inter.bandwidth),
                )?,
                latency: pick(
                    inter.latency_us,
                    US,
                    "inter_node.latency_us",
                    b.map(|c| c.inter.latency),
                )?,
            },
            efficiency: Efficiency {
                gemm: eff
                    .gemm
                    .or(b.map(|c| c.efficiency.gemm))
                    .unwrap_or(Efficiency::GPU.gemm),
                memory: eff
                    .memory
                    .or(b.map(|c| c.efficiency.memory))
                    .unwrap_or(Efficiency::GPU.memory),
                link: eff
                    .link
                    .or(b.map(|c| c.efficiency.link))
                    .unwrap_or(Efficiency::GPU.link),
            },
            device: file.device.or(b.map(|c| c.device)).unwrap_or_default(),
            network_cpu: file
                .network_cpu_ns_per_byte
                .map(|v| v * 1e-9)
                .or(b.map(|c| c.network_cpu))
                .unwrap_or(0.0),
        };
        // a range error points at the key's line when the file has it
        cluster.validate_from(&at(None)).map_err(|e| match e {
            Error::Cluster {
                key: Some(key),
                message,
                ..
            } => Error::Cluster {
                origin: at(position_of(&key)),
                key: Some(key),
                message,
            },
            other => other,
        })?;
        Ok(cluster)
    }

    /// The description as a cluster file (which [`from_toml`](Self::from_toml)
    /// reads back).
    ///
    /// # Panics
    /// Never: every field serializes.
    #[must_use]
    pub fn to_toml(&self) -> String {
        let file = ClusterFile {
            name: Some(self.name.clone()),
            base: None,
            gpus: Some(self.gpus),
            gpus_per_node: Some(self.gpus_per_node),
            memory_gib: Some(self.memory / GIB),
            memory_bandwidth_gbs: Some(self.memory_bandwidth / GB),
            launch_overhead_us: Some(self.launch_overhead / US),
            device: Some(self.device),
            network_cpu_ns_per_byte: (self.network_cpu != 0.0).then_some(self.network_cpu * 1e9),
            peak_tflops: Some(PeakFile {
                fp32: Some(self.peak.fp32 / TFLOPS),
                bf16: Some(self.peak.bf16 / TFLOPS),
                fp16: Some(self.peak.fp16 / TFLOPS),
            }),
            intra_node: Some(LinkFile {
                bandwidth_gbs: Some(self.intra.bandwidth / GB),
                latency_us: Some(self.intra.latency / US),
            }),
            inter_node: Some(LinkFile {
                bandwidth_gbs: Some(self.inter.bandwidth / GB),
                latency_us: Some(self.inter.latency / US),
            }),
            efficiency: Some(EfficiencyFile {
                gemm: Some(self.efficiency.gemm),
                memory: Some(self.efficiency.memory),
                link: Some(self.efficiency.link),
            }),
        };
        toml::to_string_pretty(&file).expect("a cluster always serializes")
    }
}

impl fmt::Display for Cluster {
    /// `h100: 64 GPUs (8 per node), 80 GiB, 989 TFLOP/s bf16, ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} {} ({} per node), {:.1} GiB and {:.0} GB/s each, peak {:.1} TFLOP/s bf16 / {:.1} fp32, \
             links {:.0} GB/s + {:.1} µs in a node, {:.1} GB/s + {:.1} µs between nodes",
            self.name,
            self.gpus,
            if self.device.shares_machine() {
                "ranks"
            } else {
                "GPUs"
            },
            self.gpus_per_node,
            self.memory / GIB,
            self.memory_bandwidth / GB,
            self.peak.bf16 / TFLOPS,
            self.peak.fp32 / TFLOPS,
            self.intra.bandwidth / GB,
            self.intra.latency / US,
            self.inter.bandwidth / GB,
            self.inter.latency / US,
        )
    }
}

/// The file form: every key optional (a `base` preset fills the rest).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    base: Option<String>,
    gpus: Option<usize>,
    gpus_per_node: Option<usize>,
    memory_gib: Option<f64>,
    memory_bandwidth_gbs: Option<f64>,
    launch_overhead_us: Option<f64>,
    device: Option<Device>,
    #[serde(skip_serializing_if = "Option::is_none")]
    network_cpu_ns_per_byte: Option<f64>,
    peak_tflops: Option<PeakFile>,
    intra_node: Option<LinkFile>,
    inter_node: Option<LinkFile>,
    efficiency: Option<EfficiencyFile>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeakFile {
    fp32: Option<f64>,
    bf16: Option<f64>,
    fp16: Option<f64>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkFile {
    bandwidth_gbs: Option<f64>,
    latency_us: Option<f64>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EfficiencyFile {
    gemm: Option<f64>,
    memory: Option<f64>,
    link: Option<f64>,
}

/// 1-based line and column of byte offset `at`.
fn line_col(text: &str, at: usize) -> (usize, usize) {
    let before = &text[..at.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before
        .rfind('\n')
        .map_or(before.len(), |nl| before.len() - nl - 1)
        + 1;
    (line, col)
}

/// The dotted key assigned on `line` (1-based), with its `[section]`.
fn key_at_line(text: &str, line: usize) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let this = lines.get(line.checked_sub(1)?)?.trim();
    let (key, _) = this.split_once('=')?;
    let key = key.trim().trim_matches('"');
    let section = lines[..line - 1].iter().rev().find_map(|l| {
        let l = l.trim();
        (l.starts_with('[') && l.ends_with(']'))
            .then(|| l.trim_matches(|c| c == '[' || c == ']').trim())
    });
    Some(match section {
        Some(s) => format!("{s}.{key}"),
        None => key.to_owned(),
    })
}

/// Line and column of the dotted `key`'s assignment in `text`, if there.
fn find_key(text: &str, key: &str) -> Option<(usize, usize)> {
    (1..=text.lines().count()).find_map(|line| {
        (key_at_line(text, line).as_deref() == Some(key)).then(|| {
            let l = text.lines().nth(line - 1).unwrap_or("");
            (line, l.len() - l.trim_start().len() + 1)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_round_trip_through_toml() {
        for name in PRESETS {
            let c = Cluster::preset(name, 64).unwrap();
            c.validate().unwrap();
            let back = Cluster::from_toml(&c.to_toml(), "x.toml").unwrap();
            for (a, b) in [
                (c.memory, back.memory),
                (c.peak.bf16, back.peak.bf16),
                (c.inter.bandwidth, back.inter.bandwidth),
                (c.intra.latency, back.intra.latency),
            ] {
                assert!((a - b).abs() <= 1e-9 * a.abs(), "{name}: {a} vs {b}");
            }
            assert_eq!(back.gpus, 64);
        }
        assert!(matches!(
            Cluster::preset("tpu", 1),
            Err(Error::UnknownPreset { .. })
        ));
    }

    #[test]
    fn base_preset_fills_what_the_file_leaves_out() {
        let c = Cluster::from_toml(
            "base = \"h100\"\ngpus = 16\n[inter_node]\nbandwidth_gbs = 25\n",
            "c.toml",
        )
        .unwrap();
        assert_eq!(c.gpus, 16);
        assert_eq!(c.inter.bandwidth, 25e9);
        assert_eq!(c.peak.bf16, 989e12);
    }

    #[test]
    fn errors_name_file_line_and_key() {
        let e = Cluster::from_toml(
            "base = \"h100\"\n[intra_node]\nbandwith_gbs = 3\n",
            "c.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("c.toml:3:"), "{e}");
        assert!(e.contains("bandwith_gbs"), "{e}");
        let e = Cluster::from_toml("base = \"h100\"\ngpus = \"many\"\n", "c.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("c.toml:2:") && e.contains("key `gpus`"),
            "{e}"
        );
        let e = Cluster::from_toml("base = \"h100\"\n[efficiency]\ngemm = 1.5\n", "c.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("c.toml:3:") && e.contains("efficiency.gemm"),
            "{e}"
        );
        let e = Cluster::from_toml("gpus = 8\n", "c.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpus_per_node") && e.contains("missing"), "{e}");
        let e = Cluster::from_toml("base = \"tpu9\"\n", "c.toml")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("c.toml:1:") && e.contains("h100"), "{e}");
    }
}

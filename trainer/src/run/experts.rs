//! Mixture-of-experts runs: each step's expert load over the global batch
//! into `expert_load.jsonl` (one record per expert layer), the auxiliary-loss-free
//! bias balancing after an applied update, and the step's MaxVio.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use weft_collectives::Communicator;
use weft_model::{MoeStats, TrainModel};
use weft_moe::BiasBalancer;
use weft_trace::{ExpertLoadRecord, input};

use crate::ranks::agree;
use crate::run::folder::io_err;
use crate::train::TrainError;

/// A mixture-of-experts rank's statistics handle and balancing.
pub(crate) struct MoeRun {
    /// The forwards' statistics (the model's blocks log them).
    pub stats: MoeStats,
    /// Layers of the model.
    pub layers: usize,
    /// The first layers, dense: no expert load to log.
    pub first_dense: usize,
    /// Experts per layer.
    pub experts: usize,
    /// The selection-bias balancer (`balance = "bias"`).
    pub balancer: Option<BiasBalancer>,
}

/// `expert_load.jsonl` and the balancing of a run (nothing for a dense
/// model).
pub(crate) struct Experts {
    moe: Option<MoeRun>,
    log: Option<BufWriter<Box<dyn Write>>>,
    path: PathBuf,
}

impl Experts {
    /// Opens `run_dir/expert_load.jsonl` on world rank 0, keeping the
    /// records up to `start_step` (a resumed checkpoint's). Collective
    /// over `world`.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn open(
        moe: Option<MoeRun>,
        world: &dyn Communicator,
        run_dir: &Path,
        start_step: u64,
    ) -> Result<Self, TrainError> {
        let path = run_dir.join("expert_load.jsonl");
        let log = (|| -> Result<Option<BufWriter<Box<dyn Write>>>, TrainError> {
            if moe.is_none() {
                return Ok(None);
            }
            if world.rank() != 0 {
                return Ok(Some(BufWriter::new(Box::new(std::io::sink()))));
            }
            let kept: String = input::read_to_string(&path, input::LOG_BYTES)
                .unwrap_or_default()
                .lines()
                .filter(|l| {
                    serde_json::from_str::<ExpertLoadRecord>(l).is_ok_and(|r| r.step <= start_step)
                })
                .map(|l| format!("{l}\n"))
                .collect();
            std::fs::write(&path, kept).map_err(io_err(&path))?;
            let f = std::fs::OpenOptions::new().append(true).open(&path);
            Ok(Some(BufWriter::new(Box::new(f.map_err(io_err(&path))?))))
        })();
        Ok(Self {
            log: agree(world, log)?,
            moe,
            path,
        })
    }

    /// Forgets what evaluation forwards logged.
    pub(crate) fn forget(&self) {
        if let Some(moe) = &self.moe {
            moe.stats.take();
        }
    }

    /// After step `step` (1-based): every expert layer's load over the
    /// global batch logged (under its index in the model), the selection biases moved when the update was
    /// `applied`; returns the step's MaxVio averaged over layers, and on
    /// world rank 0 the records logged.
    /// Collective over the model's data-parallel and pipeline groups.
    ///
    /// # Errors
    /// The model's; a failed write.
    pub(crate) fn step<M: TrainModel + ?Sized>(
        &mut self,
        model: &mut M,
        step: u64,
        applied: bool,
    ) -> Result<(Option<f64>, Vec<ExpertLoadRecord>), TrainError> {
        let (Some(moe), Some(mesh)) = (&self.moe, model.mesh()) else {
            return Ok((None, Vec::new()));
        };
        let mut records = Vec::new();
        let loads = moe.stats.step_loads(mesh, moe.layers, moe.experts)?;
        let mut vios = Vec::new();
        for (l, st) in loads.iter().enumerate().skip(moe.first_dense) {
            let rec = st.to_record(step, u32::try_from(l).unwrap_or(u32::MAX));
            if let Some(log) = self.log.as_mut() {
                let line = serde_json::to_string(&rec).unwrap_or_default();
                writeln!(log, "{line}").map_err(io_err(&self.path))?;
                records.push(rec);
            }
            vios.extend(st.max_vio());
        }
        if let (Some(balancer), true) = (&moe.balancer, applied) {
            model.balance_experts(balancer, &loads)?;
        }
        #[allow(clippy::cast_precision_loss)]
        let max_vio = (!vios.is_empty()).then(|| vios.iter().sum::<f64>() / vios.len() as f64);
        Ok((max_vio, records))
    }

    /// Writes what is buffered.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn flush(&mut self) -> Result<(), TrainError> {
        match self.log.as_mut() {
            Some(log) => log.flush().map_err(io_err(&self.path)),
            None => Ok(()),
        }
    }
}

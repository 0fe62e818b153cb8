//! The training loop on one GPU (feature `cuda`): `train.device = "cuda"`
//! or `"cuda:N"`.
//!
//! The model is `weft_model::cuda::CudaGpt` — the dense GPT-2 with its
//! parameters, gradients and AdamW moments on the device in the host
//! model's layout — trained as one rank: the same data (batches as pure
//! functions of the step, the same skips), learning-rate schedule, AdamW
//! hyper-parameters, gradient accumulation over `train.micro_batch_size`
//! micro-batches, exact global gradient norm, clipping and non-finite
//! check as the loop over ranks ([`crate::train`]), evaluation by forward
//! passes only, and the same run folder ([`crate::run`]): `config.toml`,
//! `metrics.jsonl`, `summary.json`, and checkpoints holding the whole
//! model and moments, downloaded, in the format the CPU writes — so a
//! checkpoint of either device resumes on the other. What the GPU loop
//! does not do is refused by [`Config::gpu_support`] before anything
//! starts.
//!
//! Utilisation is against the GPU's datasheet dense peak in the run's
//! precision (`weft plan`'s presets: A100, H100 SXM, H200), unknown for
//! other GPUs. Every `--inject` fault fires here as in the loop over
//! ranks: `nan` makes the first parameter non-finite for its steps (the
//! step is skipped and reported, the value put back), `slow` sleeps the
//! step's own time again per unit of its factor.
//!
//! Not yet run on a GPU: it compiles and lints in CI, and
//! `scripts/gpu-check.sh` runs it against the CPU loop on a GPU machine.

use std::time::Instant;

use weft_collectives::{Communicator, LocalCluster};
use weft_kernels::Mode;
use weft_kernels::cuda::Gpu;
use weft_model::cuda::CudaGpt;
use weft_model::{Gpt, RankMemory};

use crate::config::{Config, Device};
use crate::run::{Kept, Metrics, Spikes};
use crate::schedule::lr_at;
use crate::train::{
    Observer, RunInfo, Skips, Summary, TrainError, batch_split, check_device, check_model_floor,
    device_error, gib, layout_name, model_config,
};
use weft_data::Dataset;

/// Runs the job on GPU `N` of `train.device = "cuda:N"`, as one rank of
/// this process (see [`crate::train::train`]).
///
/// # Errors
/// As [`crate::train::train`]; a configuration error naming the key the
/// GPU loop does not support, or `train.device` when the GPU cannot be
/// used; [`TrainError::Backend`] under a launcher of several processes;
/// [`TrainError::OutOfMemory`] when the model does not fit the GPU.
pub(crate) fn train(
    config: &Config,
    resume: bool,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    config.validate()?;
    check_device(config)?;
    let Device::Cuda(ordinal) = config.train.device else {
        return Err(device_error("the GPU loop needs a CUDA device".into()));
    };
    if let Some(env) = crate::ranks::LauncherEnv::detect()
        && env.size > 1
    {
        return Err(TrainError::Backend(format!(
            "train.device = \"{}\" trains as one rank, but {} started {} processes: start weft once, without the launcher",
            config.train.device.name(),
            env.launcher,
            env.size
        )));
    }
    // the host holds the parameters and moments at checkpoints
    check_model_floor(config)?;
    let data = Dataset::open(&config.data, &config.dataset_options())?;
    let gpu = Gpu::new(ordinal).map_err(|e| device_error(format!("`cuda:{ordinal}`: {e}")))?;
    run(
        config,
        resume,
        &data,
        gpu,
        &LocalCluster::single(),
        observer,
    )
}

/// The datasheet's dense peak (FLOP/s) of the GPU called `name` for
/// products in `precision`, from `weft plan`'s presets (A100: 312
/// TFLOP/s bf16/fp16, 19.5 fp32; H100 SXM and H200: 989 and 67), and
/// where it comes from; NaN and "unknown" for any other GPU (an H100
/// PCIe or NVL has other clocks). f32 products run without TF32, so the
/// f32 peak is the one without tensor cores.
pub(crate) fn datasheet_peak(name: &str, precision: weft_kernels::Precision) -> (f64, String) {
    use weft_kernels::Precision as P;
    let upper = name.to_ascii_uppercase();
    let preset = if upper.contains("H200") {
        Some(("h200", "H200"))
    } else if upper.contains("H100") && !upper.contains("PCIE") && !upper.contains("NVL") {
        Some(("h100", "H100 SXM"))
    } else if upper.contains("A100") {
        Some(("a100", "A100"))
    } else {
        None
    };
    let plan = match precision {
        P::Fp32 => weft_plan::Precision::Fp32,
        P::Bf16 => weft_plan::Precision::Bf16,
        P::Fp16 => weft_plan::Precision::Fp16,
    };
    match preset.and_then(|(p, what)| Some((weft_plan::Cluster::preset(p, 1).ok()?, what))) {
        Some((cluster, what)) => (
            cluster.peak.of(plan),
            format!(
                "the {what} datasheet's dense {} peak (weft plan's `{}` preset), for {name}",
                precision.name(),
                cluster.name
            ),
        ),
        None => (
            f64::NAN,
            format!("unknown peak: {name} is not in the table (A100, H100 SXM, H200)"),
        ),
    }
}

/// Refuses a run whose model, gradients, moments and activations do not
/// fit in the GPU's free memory, before any of it is allocated.
fn check_gpu_memory(gpu: &Gpu, device: &str, needed: &RankMemory) -> Result<(), TrainError> {
    let (free, _) = gpu
        .memory()
        .map_err(|e| device_error(format!("{device}: {e}")))?;
    if needed.total() <= free {
        return Ok(());
    }
    let (name, bytes) = needed.largest();
    #[allow(clippy::cast_precision_loss)]
    let gib = |b: usize| gib(b as f64);
    Err(TrainError::OutOfMemory {
        needed: gib(needed.total()),
        available: format!("{} free on {device}", gib(free)),
        ranks: 1,
        detail: format!("on the GPU: {needed}"),
        dominant: format!(
            "{name} ({}) — lower train.micro_batch_size or model.block_size (activations), or train a smaller model",
            gib(bytes)
        ),
    })
}

/// The run on `gpu`, over the one-rank `world` (which the run folder,
/// checkpoint and stop helpers take).
#[allow(clippy::too_many_lines)]
fn run(
    config: &Config,
    resume: bool,
    data: &Dataset,
    gpu: Gpu,
    world: &dyn Communicator,
    observer: &mut dyn Observer,
) -> Result<Summary, TrainError> {
    let t = &config.train;
    let vocab = data.vocab_size();
    let cfg = model_config(config, vocab);
    let split = batch_split(config)?;
    let seq = config.model.block_size;
    // the host model: its initial parameters (a single CPU rank's) and
    // layout; a resumed run reads the checkpoint into it
    let mut host = Gpt::new(cfg.clone())?;
    host.init_gpt2(t.seed);
    let device = format!("{} ({})", t.device.name(), gpu.name());
    let (peak, peak_source) = datasheet_peak(gpu.name(), t.precision);
    let predicted = CudaGpt::predict_memory(&host, split.micro, seq, t.precision);
    check_gpu_memory(&gpu, &device, &predicted)?;

    let run_dir = crate::run::open_run_dir(config, world, resume)?;
    let ckpt_root = run_dir.join("checkpoints");
    let mut kept = Kept::default();
    let mut start_step = 0;
    let mut restored = None;
    if resume {
        let mut opt = host.adamw_state();
        let layout = host.layout().clone();
        let r = crate::ckpt::restore_with(world, &ckpt_root, config, &mut |step, read| {
            crate::ckpt::read_whole(&layout, &mut host.params, &mut opt, step, read)
        })?;
        start_step = crate::run::resume_step(config, &run_dir, &r, observer)?;
        restored = Some(opt);
        kept = Kept::read(world, &run_dir, start_step)?;
    }
    let skips = Skips::for_run(world, &run_dir, resume, &t.skip_batches)?;
    let hp = crate::run::adamw(&config.optim, config.optim.lr);
    let precision = t.precision;
    let mut model = CudaGpt::new(
        gpu,
        &host,
        split.micro,
        seq,
        hp,
        Mode::Throughput,
        precision,
    )?;
    if let Some(opt) = &restored {
        model.set_optimizer_state(opt)?;
    }
    let layout = host.layout().clone();
    drop(host);

    let floor = data.val_floor(t.eval_sequences);
    let mut metrics = Metrics::open(world, &run_dir, &kept, floor)?;
    let val = data.val_batches(t.eval_sequences, split.micro)?;
    let val_mbs = crate::run::micro_batches(&val);
    let memory = model.memory();
    let info = RunInfo {
        run_dir: run_dir.clone(),
        precision: t.precision,
        params: layout.len(),
        vocab,
        tokens_per_step: t.batch_size * seq,
        flops_per_token: crate::run::flops_per_token(config, &layout),
        peak_flops: peak,
        peak_source,
        floor,
        steps: t.steps,
        activation_bytes: memory.activations,
        fp32_activation_bytes: None,
        layout: format!("{} on {device}", layout_name(config)),
        mesh: "one GPU".into(),
        coords: vec![format!("rank 0: {device}")],
        backend: format!("one thread of this process, computing on {device}"),
        predicted_memory: predicted,
        data_shares: data.shares(t.steps * t.batch_size as u64),
        doc_mask: false,
        memory,
    };
    observer.start(&info);

    let start = Instant::now();
    if !resume {
        let e = model.eval_loss(&val_mbs)?;
        metrics.eval(observer, 0, e)?;
    }
    let mut spikes = Spikes::new(config, &kept);
    let mut last_step_time = std::time::Duration::ZERO;
    crate::supervise::heartbeat(&run_dir, 0, start_step);
    for step in start_step..t.steps {
        crate::supervise::before_step(&run_dir, step + 1, 0);
        let step_start = Instant::now();
        let lr = lr_at(&config.optim, step, t.steps);
        let batch = skips.batch_of(step);
        let batches =
            crate::run::read_batches(data, batch, 0..split.per_rank, split.micro, Some(&run_dir))?;
        let hp = crate::run::adamw(&config.optim, lr);
        let slow = crate::supervise::slowdown(step + 1, 0);
        let slept = last_step_time.mul_f64(slow - 1.0);
        std::thread::sleep(slept);
        let poisoned = match crate::supervise::nan_at(batch + 1) {
            Some(f) => {
                if batch + 1 == f.step {
                    crate::supervise::fired(&run_dir, &f, 0);
                }
                poison(&mut model, &layout)?
            }
            None => None,
        };
        let out = model.train_step_batches(
            &crate::run::micro_batches(&batches),
            &hp,
            config.optim.grad_clip,
        )?;
        if let Some((name, values)) = poisoned {
            model.write_param(&name, &values)?;
        }
        // the step's work is done when the device's queue is
        model.gpu().synchronize().map_err(weft_model::Error::from)?;
        last_step_time = step_start.elapsed().saturating_sub(slept);
        if !out.applied {
            let event = crate::run::skip_event(step + 1, out.loss, out.grad_norm);
            metrics.health(observer, event)?;
        }
        if let Some(median) = spikes.check(out.loss) {
            let event = crate::run::spike_event(step + 1, out.loss, median, (batch, split.global));
            metrics.health(observer, event)?;
        }
        let times = (step_start.elapsed(), start.elapsed());
        let report = metrics.step(&info, step + 1, lr, &out, None, times, None)?;
        crate::supervise::heartbeat(&run_dir, 0, step + 1);
        observer.step(&report);
        let done = step + 1 == t.steps;
        if crate::run::eval_due(config, step + 1, done) {
            let e = model.eval_loss(&val_mbs)?;
            metrics.eval(observer, step + 1, e)?;
        }
        let stop = !done && crate::stop::agreed(world)?;
        if crate::run::save_due(config, step + 1, done, stop) {
            // Everything logged so far belongs to the checkpoint.
            metrics.flush()?;
            let opt = model.optimizer_state()?;
            let parts = crate::ckpt::whole_parts(&layout, &model.params()?, &opt);
            let mesh = config.parallel.dims().mesh_dims();
            crate::ckpt::save_sharded(
                world,
                &ckpt_root,
                config,
                step + 1,
                &parts,
                opt.step,
                None,
                &cfg,
                &mesh,
            )?;
            let dir = ckpt_root.join(weft_checkpoint::step_dir_name(step + 1));
            crate::supervise::after_save(&dir, step + 1, 0);
        }
        if stop {
            return Err(TrainError::Stopped {
                step: step + 1,
                run: run_dir,
            });
        }
    }
    metrics.flush()?;
    let summary = metrics.summary(&info, start.elapsed());
    crate::run::finish(true, &summary, observer)?;
    Ok(summary)
}

/// A `nan` fault on the device: the first value of the first parameter
/// tensor made NaN (the tied head then makes every logit, and the loss,
/// non-finite). Returns the tensor's values, to put back after the step.
fn poison(
    model: &mut CudaGpt,
    layout: &weft_model::ParamLayout,
) -> Result<Option<(String, Vec<f32>)>, TrainError> {
    for spec in layout.specs() {
        let values = model.read_param(&spec.name)?;
        let mut bad = values.clone();
        if let Some(v) = bad.first_mut() {
            *v = f32::NAN;
            model.write_param(&spec.name, &bad)?;
            return Ok(Some((spec.name.clone(), values)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_kernels::Precision;
    use weft_model::AdamWState;

    #[test]
    fn the_peak_is_the_datasheet_of_known_gpus_and_unknown_otherwise() {
        let (p, from) = datasheet_peak("NVIDIA H100 80GB HBM3", Precision::Bf16);
        assert_eq!(p, 989e12);
        assert!(from.contains("H100 SXM") && from.contains("bf16"), "{from}");
        assert_eq!(datasheet_peak("NVIDIA H200", Precision::Bf16).0, 989e12);
        assert_eq!(
            datasheet_peak("NVIDIA A100-SXM4-80GB", Precision::Bf16).0,
            312e12
        );
        assert_eq!(
            datasheet_peak("NVIDIA A100-SXM4-40GB", Precision::Fp32).0,
            19.5e12
        );
        for other in ["NVIDIA H100 PCIe", "NVIDIA GeForce RTX 4090", "Tesla T4"] {
            let (p, from) = datasheet_peak(other, Precision::Bf16);
            assert!(p.is_nan(), "{other}");
            assert!(
                from.starts_with("unknown peak") && from.contains(other),
                "{from}"
            );
        }
    }

    /// The checkpoint the GPU loop writes is the whole model's parts, and
    /// reading them back through the checkpoint's reader restores every
    /// buffer.
    #[test]
    fn whole_parts_read_back_into_the_flat_buffers() {
        let config = Config::default();
        let mut gpt = Gpt::new(model_config(&config, 64)).unwrap();
        gpt.init_gpt2(3);
        let layout = gpt.layout().clone();
        let mut opt = gpt.adamw_state();
        for (i, (m, v)) in opt.m.iter_mut().zip(&mut opt.v).enumerate() {
            #[allow(clippy::cast_precision_loss)]
            let x = i as f32;
            (*m, *v) = (x, 2.0 * x);
        }
        let parts = crate::ckpt::whole_parts(&layout, &gpt.params, &opt);
        assert_eq!(parts.len(), layout.specs().len());
        let (mut params, mut back) = (vec![0.0; layout.len()], AdamWState::zeros(layout.len()));
        let mut read = |which: usize,
                        name: &str,
                        out: &mut [f32]|
         -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let part = parts.iter().find(|p| p.name == name).ok_or("missing")?;
            out.copy_from_slice(&part.values[which]);
            Ok(())
        };
        crate::ckpt::read_whole(&layout, &mut params, &mut back, 7, &mut read).unwrap();
        assert_eq!(params, gpt.params);
        assert_eq!((back.m, back.v, back.step), (opt.m, opt.v, 7));
    }
}

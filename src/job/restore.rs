//! A trained GPT back from a distributed checkpoint of any layout, for inference (`sample --from
//! CHECKPOINT`): the model's shape and data from the job the checkpoint was saved by, each weight
//! assembled from the pieces every rank wrote ([`read_tensor`](crate::checkpoint::read_tensor),
//! checksums checked). No optimizer state is read.

use super::{DataSource, GptJob};
use crate::model::{Gpt, Model};
use anyhow::Context;
use std::path::{Path, PathBuf};

/// What [`load_gpt`] restored.
pub struct Restored {
    pub model: Gpt,
    /// The job that saved it (its model shape, data, seed).
    pub job: GptJob,
    /// The step folder read (a checkpoint folder resolves to its latest).
    pub path: PathBuf,
    pub step: u64,
}

impl Restored {
    /// The vocabulary file of the data it was trained on (`meta.json` of a nanoGPT-layout folder),
    /// if there is one.
    pub fn meta_path(&self) -> Option<PathBuf> {
        match &self.job.data {
            DataSource::Dir(d) => Some(d.join("meta.json")).filter(|p| p.is_file()),
            _ => None,
        }
    }
}

/// The GPT saved in the checkpoint at `path` (a step-N folder, or a folder of them: its latest),
/// on the CPU, in f32 (the master weights).
pub fn load_gpt(path: &Path) -> anyhow::Result<Restored> {
    let dir = crate::checkpoint::resolve(path)?;
    let meta = crate::checkpoint::read_metadata(&dir)?;
    let saved = meta.extra.get("job").cloned().map(serde_json::from_value::<GptJob>);
    let job = saved.and_then(Result::ok).with_context(|| {
        format!("{} was not saved by a GPT training job (no GPT job in its metadata)", dir.display())
    })?;
    let model = Gpt::new(job.model, job.seed)?;
    tch::no_grad(|| -> anyhow::Result<()> {
        for (name, p) in model.named_parameters() {
            let t = crate::checkpoint::read_tensor(&dir, &format!("param/{name}"))?;
            anyhow::ensure!(
                t.size() == p.size(),
                "{name}: shape {:?} in the checkpoint, {:?} in its job's model",
                t.size(),
                p.size()
            );
            p.shallow_clone().copy_(&t);
        }
        Ok(())
    })?;
    Ok(Restored { model, job, path: dir, step: meta.step })
}

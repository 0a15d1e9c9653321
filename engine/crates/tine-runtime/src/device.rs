//! Choosing where a model runs: `--device cpu` (the default) or `--device cuda[:N]`.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

/// A device named on the command line: `cpu`, `cuda` (GPU 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda(usize),
}

/// Why a [`DeviceSpec`] could not be parsed or opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device `{0}`: expected cpu, cuda or cuda:N")]
    Parse(String),
    #[error("--device {spec}: this tine was built without CUDA (build it with tools/cuda/build.sh, or `cargo build --release -p tine-cli --features cuda` with a CUDA toolkit)")]
    NotCompiled { spec: DeviceSpec },
    #[error("--device {spec}: cannot load {missing}: tine looks beside itself, in its build's CUDA venv and on LD_LIBRARY_PATH (the driver provides libcuda; a CUDA 13 toolkit's lib64 or PyTorch's nvidia/cu13/lib the others)")]
    Libraries { spec: DeviceSpec, missing: String },
    #[error("--device {spec}: cannot open the GPU (is the NVIDIA driver loaded and the GPU visible?)")]
    Open {
        spec: DeviceSpec,
        #[source]
        source: candle_core::Error,
    },
}

/// Whether this build carries candle's CUDA backend (the `cuda` feature).
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

impl DeviceSpec {
    /// Opens the device. Each call opens a new CUDA context and stream: tensors of two opened
    /// devices do not mix, so whatever works with a model (a draft model, a head) takes
    /// [`crate::Model::device`] rather than opening its own.
    pub fn open(self) -> Result<Device, DeviceError> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(_) if !CUDA_COMPILED => Err(DeviceError::NotCompiled { spec: self }),
            DeviceSpec::Cuda(n) => {
                let missing = missing_cuda_libraries();
                if !missing.is_empty() {
                    return Err(DeviceError::Libraries { spec: self, missing: missing.join(", ") });
                }
                Device::new_cuda(n).map_err(|source| DeviceError::Open { spec: self, source })
            }
        }
    }

    pub fn is_cpu(self) -> bool {
        self == DeviceSpec::Cpu
    }
}

/// The CUDA libraries candle opens when it makes a device (at run time: patch 0021) that cannot
/// be loaded here. candle would panic on the first of them; this names them all.
#[cfg(feature = "cuda")]
pub fn missing_cuda_libraries() -> Vec<&'static str> {
    // SAFETY: each check dlopens NVIDIA's library (running its initialisers) and closes it again;
    // candle loads the same files right after.
    let present = unsafe {
        [
            ("libcuda.so.1 (the NVIDIA driver)", cudarc::driver::sys::is_culib_present()),
            ("libcublas.so.13 and libcublasLt.so.13", cudarc::cublas::sys::is_culib_present()),
            ("libcurand.so.10", cudarc::curand::sys::is_culib_present()),
        ]
    };
    present.into_iter().filter(|(_, ok)| !ok).map(|(name, _)| name).collect()
}

/// Without the `cuda` feature there is nothing to load.
#[cfg(not(feature = "cuda"))]
pub fn missing_cuda_libraries() -> Vec<&'static str> {
    Vec::new()
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(0)),
            _ => t.strip_prefix("cuda:").or_else(|| t.strip_prefix("gpu:")).and_then(|n| n.parse().ok()).map(DeviceSpec::Cuda).ok_or_else(|| DeviceError::Parse(s.to_owned())),
        }
    }
}

/// A short description of `device` for logs: `cpu`, `cuda:0`.
pub fn describe(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_owned(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

//! [`Mesh`]: an N-dimensional device mesh with named dimensions.

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::OpKind;

/// An N-dimensional arrangement of a group's ranks with named dimensions
/// (e.g. `pp=2, dp=2, tp=2`), like torch's `DeviceMesh`.
///
/// # Rank order
/// Ranks are laid out row-major: the **last** dimension varies fastest.
/// With `[("pp", 2), ("dp", 2), ("tp", 2)]`, rank `r` has coordinates
/// `pp = r / 4`, `dp = (r / 2) % 2`, `tp = r % 2`, so the ranks of one
/// tensor-parallel group are consecutive and land in one fast domain (node)
/// of a [`Topology`](crate::Topology). Put the dimension that talks most
/// (tp, then ep or dp) last.
///
/// # Example
/// ```
/// use weft_collectives::{Communicator, CommunicatorExt, LocalCluster, Mesh, ReduceOp};
///
/// LocalCluster::run(8, |comm| {
///     let mesh = Mesh::new(&comm, &[("pp", 2), ("dp", 2), ("tp", 2)])?;
///     let tp = mesh.dim("tp")?;
///     assert_eq!(tp.size(), 2);
///     // Sum over the data-parallel dimension only.
///     let mut g = vec![1.0f32; 4];
///     mesh.dim("dp")?.all_reduce(&mut g, ReduceOp::Sum)?;
///     assert_eq!(g, vec![2.0; 4]);
///     Ok::<(), weft_collectives::Error>(())
/// })?
/// .into_iter()
/// .collect::<Result<Vec<()>, _>>()?;
/// # Ok::<(), weft_collectives::Error>(())
/// ```
pub struct Mesh {
    names: Vec<String>,
    shape: Vec<usize>,
    coords: Vec<usize>,
    dims: Vec<Box<dyn Communicator>>,
    parent: Box<dyn Communicator>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("names", &self.names)
            .field("shape", &self.shape)
            .field("coords", &self.coords)
            .finish_non_exhaustive()
    }
}

fn invalid(arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument {
        op: OpKind::Split,
        arg,
        reason,
    }
}

impl Mesh {
    /// Builds the mesh over `comm`'s ranks and one communicator per
    /// dimension. Collective: every rank of `comm` must call it with the
    /// same dimensions.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the sizes do not multiply to
    /// `comm.size()`, a size is 0, or a name repeats; collective errors
    /// from the splits.
    pub fn new<C: Communicator + ?Sized>(comm: &C, dims: &[(&str, usize)]) -> Result<Self> {
        let product: usize = dims.iter().map(|d| d.1).product();
        if dims.iter().any(|d| d.1 == 0) || product != comm.size() {
            return Err(invalid(
                "dims",
                format!(
                    "sizes {:?} multiply to {product}, but the group has {} ranks",
                    dims,
                    comm.size()
                ),
            ));
        }
        for (i, d) in dims.iter().enumerate() {
            if dims[..i].iter().any(|e| e.0 == d.0) {
                return Err(invalid("dims", format!("dimension name {:?} repeats", d.0)));
            }
        }
        let shape: Vec<usize> = dims.iter().map(|d| d.1).collect();
        let coords = unravel(comm.rank(), &shape);
        let parent = comm.split(0, comm.rank() as u32)?;
        let mut mesh = Self {
            names: dims.iter().map(|d| d.0.to_owned()).collect(),
            shape,
            coords,
            dims: Vec::new(),
            parent,
        };
        for i in 0..dims.len() {
            let c = mesh.split_over(&[i])?;
            mesh.dims.push(c);
        }
        Ok(mesh)
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            invalid(
                "name",
                format!("no dimension {name:?}; the mesh has {:?}", self.names),
            )
        })
    }

    fn split_over(&self, sel: &[usize]) -> Result<Box<dyn Communicator>> {
        // color: the coordinates outside `sel`; key: those inside, row-major.
        let mut color = 0usize;
        let mut key = 0usize;
        for (i, (&c, &s)) in self.coords.iter().zip(&self.shape).enumerate() {
            if sel.contains(&i) {
                key = key * s + c;
            } else {
                color = color * s + c;
            }
        }
        self.parent.split(color as u32, key as u32)
    }

    /// The dimension names, slowest first.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The sizes, slowest first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// This rank's coordinates, slowest first.
    pub fn coords(&self) -> &[usize] {
        &self.coords
    }

    /// This rank's coordinate along `name`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown name.
    pub fn coord(&self, name: &str) -> Result<usize> {
        Ok(self.coords[self.index(name)?])
    }

    /// The communicator along one dimension: the ranks that share every
    /// other coordinate, ordered by their coordinate along `name`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown name.
    pub fn dim(&self, name: &str) -> Result<&dyn Communicator> {
        Ok(&*self.dims[self.index(name)?])
    }

    /// A communicator over several dimensions together (e.g. `["dp", "tp"]`
    /// for a ZeRO group spanning both), ordered row-major in mesh order.
    /// Collective over the whole mesh.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown name; collective errors.
    pub fn group(&self, names: &[&str]) -> Result<Box<dyn Communicator>> {
        let sel = names
            .iter()
            .map(|n| self.index(n))
            .collect::<Result<Vec<_>>>()?;
        self.split_over(&sel)
    }

    /// The rank (in the mesh's group) at `coords`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for coordinates of the wrong arity or out of range.
    pub fn rank_at(&self, coords: &[usize]) -> Result<usize> {
        if coords.len() != self.shape.len() || coords.iter().zip(&self.shape).any(|(c, s)| c >= s) {
            return Err(invalid(
                "coords",
                format!("{coords:?} is outside the mesh {:?}", self.shape),
            ));
        }
        Ok(coords
            .iter()
            .zip(&self.shape)
            .fold(0, |acc, (c, s)| acc * s + c))
    }
}

fn unravel(mut r: usize, shape: &[usize]) -> Vec<usize> {
    let mut c = vec![0; shape.len()];
    for i in (0..shape.len()).rev() {
        c[i] = r % shape[i];
        r /= shape[i];
    }
    c
}

"""Programmatic dependent launch (PDL, SM90+): the first statement of every Triton kernel in the kernel set.

A decode step is hundreds of small kernels (docs/performance.md); without PDL each one starts only after the
previous one has finished and its writes are flushed, so every boundary costs the launch and the ramp of the next
grid.  The cubin launcher launches each Triton kernel with the "programmatic stream serialization" attribute
(``kernel_set/cubin.py``), which lets its programs become resident while the previous kernel runs out; then

- ``griddepcontrol.wait`` holds them until the previous grid has completed and its memory is visible -- it comes
  before any load or store, so a kernel reads and writes exactly what it did without PDL (and, since every kernel
  waits before it can finish, a kernel also sees every earlier one: the order is transitive);
- ``griddepcontrol.launch_dependents`` lets the next kernel's programs be scheduled once every program of this
  one has issued it (so a many-wave grid hands SMs over only during its last wave).

Both are no-ops in a kernel launched without the attribute (Triton's JIT launcher, any other caller).  Under
Triton's CPU interpreter (``TRITON_INTERPRET=1``, which cannot run inline PTX) the helper is empty.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def wait_for_producers():
        pass

else:

    @triton.jit
    def wait_for_producers():
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

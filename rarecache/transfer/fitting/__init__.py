"""Making maps, offline: calibration text (`corpus`), streamed statistics (`stats`), the closed-form fit
(`fit`), calibration runs (`calibrate`), fitting again from kept statistics (`refit`), the residual MLP
(`mlp`) and output-aware refinement (`refine`, `refine_state`). Everything here imports the runtime path
(transfer/: the map's form, features, the handoff's budget); nothing there imports this."""

"""What measures the pipeline and trains it, never imported at run time: generated scenes and video
QA with exact answers (scenes; synth_qa, the dataset command; renderers: the original generator
shapes_qa and three more drawn with layout and draw, one held out of training; questions), a contact
sheet of the renderers (contact_sheet), MSR-VTT-layout fixtures (fixtures), the query-agnostic
token-selection baselines (baselines), and the relevance metrics (metrics).

Training, the evaluation commands, the demo's sample clip, benchmarks and tests import it; the
runtime packages (arr_coc, sources, sinks, pipeline's core, vlm, runners, serve) do not
(tests/test_layout.py).
"""

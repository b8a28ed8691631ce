"""OpenVINO as a second runtime: discovery (discover.py), the artifacts it builds from
a model (build.py: IR in f32, bf16/f16 compile hints, NNCF int8), and the worker that
measures one as deployed (deployed.py). It competes at the model level: the engine
measures its artifacts against onnxruntime's proposal with the one measurement
procedure. openvino and nncf are imported only inside these modules' functions and
their child processes, never by importing the package."""

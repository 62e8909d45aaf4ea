import cProfile, pstats, sys, torch, time
from workers import model_runner
from workers import model_loader as ml
t=time.perf_counter()
pr=cProfile.Profile(); pr.enable()
m=ml.load_model(sys.argv[1], torch.float32, 'cpu', 'dummy')
pr.disable()
print('load_model', time.perf_counter()-t)
st=pstats.Stats(pr); st.sort_stats('cumtime').print_stats(int(sys.argv[2]) if len(sys.argv)>2 else 30)
